"""The run configuration: a tree of pydantic models, loaded from a YAML recipe plus dotted overrides.

Every field is documented by the string under it (that text is also what `flashreinforce config` prints, and
docs/config.md).
Errors name the dotted field and say what to do. The resolved config is written into the run directory.
This module is configuration only: builders elsewhere turn it into flat arguments.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flashreinforce.data import instructions
from flashreinforce.verifiers.registry import parse_spec

RECIPES_DIR = Path(__file__).parent / "recipes"
LOSS_NAMES = ("flashreinforce", "grpo", "drgrpo", "dapo", "gspo", "gspo_token", "misc", "rloo", "reinforce++",
              "reinforce++-baseline", "opd")
"""algorithms/losses.py's LOSSES, by name (checked here without importing torch; a test keeps them equal)."""
SINGLE_ROLLOUT_LOSSES = frozenset({"flashreinforce", "reinforce++", "opd"})
"""Losses whose baseline is not a per-prompt group, so group_size=1 is meaningful."""
DEFAULT_RECIPE = "arithmetic"
UNDEMONSTRATED_KINDS = ("files", "reasoning_gym", "gsm8k", "env")
"""Data kinds with no built-in demonstrations (run/tasks.py's TASKS has the others): no SFT warm start, and no
tiny model, whose tokenizer is made of a built-in task's characters."""
RESERVED_TASK_NAMES = frozenset({"all", "total", "mean", "worst"})
"""Words the per-task metrics and summaries use beside task names."""


def checked_verifier(value: str | dict[str, Any]) -> str | dict[str, Any]:
    """A verifier spec with a registered kind and plain options (a "file.py:fn" or "module:fn" reference to a
    user function is checked when the verifier pool loads it)."""
    if not (isinstance(value, str) and ":" in value):
        parse_spec(value, field="verifier")
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class TinyVisionConfig(_Section):
    image_size: int = Field(64, ge=8)
    """Images are resized to image_size x image_size RGB."""
    patch_size: int = Field(8, ge=1)
    """Side of a square patch, one encoder token before merging."""
    width: int = Field(64, ge=8)
    """Width of the encoder's transformer layers."""
    num_layers: int = Field(2, ge=1)
    """Encoder transformer layers."""
    num_heads: int = Field(4, ge=1)
    """Encoder attention heads (width must be divisible by it)."""
    merge: int = Field(2, ge=1)
    """merge x merge neighbouring patches become one image token: (image_size / patch_size / merge)^2 tokens."""

    @model_validator(mode="after")
    def _shapes_fit(self) -> TinyVisionConfig:
        grid = self.image_size // self.patch_size
        if self.image_size % self.patch_size or grid % self.merge or self.width % self.num_heads:
            raise ValueError(f"image_size {self.image_size} must be a multiple of patch_size {self.patch_size}, the "
                             f"patch grid ({grid}) of merge {self.merge}, and width {self.width} of num_heads "
                             f"{self.num_heads}")
        return self


class TinyModelConfig(_Section):
    hidden_size: int = Field(128, ge=8)
    """Width of the small Qwen2-style transformer built from scratch."""
    num_layers: int = Field(2, ge=1)
    """Number of decoder layers."""
    num_heads: int = Field(4, ge=1)
    """Attention heads (hidden_size must be divisible by it)."""
    max_position_embeddings: int = Field(128, ge=16)
    """Context length of the small model, in tokens."""
    num_experts: int = Field(0, ge=0)
    """0: a dense Qwen2 model. >= 2: a Qwen2-MoE model with this many routed experts in every layer (plus a
    shared expert), each hidden_size wide."""
    experts_per_token: int = Field(2, ge=1)
    """Routed experts per token (top-k) of the MoE model."""
    vision: TinyVisionConfig | None = None
    """A small vision encoder in front of the LM (models/vision.py), for tasks whose prompts carry images;
    None: a text-only model."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_experts == 1 or (self.num_experts and self.experts_per_token > self.num_experts):
            raise ValueError(f"num_experts={self.num_experts}, experts_per_token={self.experts_per_token}: an MoE "
                             "model needs num_experts >= 2 and experts_per_token <= num_experts (0 = dense)")
        return self


class ModelConfig(_Section):
    path: str | None = None
    """A Hugging Face causal LM (weights + tokenizer): a local directory; a model id on the Hugging Face Hub
    (ORG/NAME, fetched once into the Hugging Face cache; offline, a cached one still loads); or the name of a
    model converted by `flashreinforce models get` (e.g. smollm2-135m-instruct). None builds `tiny` from scratch
    with the synthetic task's character tokenizer (and warm-starts it with `sft`)."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the model built when `path` is None."""

    @model_validator(mode="before")
    @classmethod
    def _dtype_moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "dtype" in data:
            raise ValueError("model.dtype was replaced by precision.trainer and precision.rollout (fp32, bf16 or "
                             f"fp8; {data['dtype']!r} there is "
                             f"{'bf16' if str(data['dtype']).startswith('b') else 'fp32'}): set those instead")
        return data


class PrecisionConfig(_Section):
    trainer: Literal["fp32", "bf16", "fp8"] = "fp32"
    """The trainer's weights, in RL and in an SFT warm start or stage: fp32; bf16; fp8 (e4m3 linear weights with
    power-of-two scales, fake-quantized: dequantized values, the rest in bf16). Master weights and optimizer
    state are fp32 whatever this is, and an SFT warm start hands its fp32 masters on."""
    rollout: Literal["fp32", "bf16", "fp8"] = "fp32"
    """The local engine's weights, in the same formats: the engine rounds or quantizes each weight push."""
    mode: Literal["separate", "unified"] = "separate"
    """separate: a bf16 or fp8 side computes with bf16 kernels of its own (decoding with a KV cache vs the
    trainer's whole sequences: their roundings differ). unified: both sides hold the same quantized weights and
    compute every operator in fp32, so behavior and recomputed log-probs agree to float rounding; needs
    trainer == rollout. See models/numerics.py."""
    fp8_scaling: Literal["tensor", "channel", "block"] = "channel"
    """fp8 scale granularity: one per tensor, per output channel, or per fp8_block x fp8_block tile."""
    fp8_block: int = Field(128, ge=1)
    """Tile size of fp8_scaling=block (DeepSeek-V3 uses 128)."""

    @model_validator(mode="after")
    def _unified_is_one_precision(self) -> PrecisionConfig:
        if self.mode == "unified" and self.trainer != self.rollout:
            raise ValueError(f"mode=unified runs both sides in one precision, but trainer={self.trainer} and "
                             f"rollout={self.rollout}: set them equal or use mode=separate")
        return self


class ArithmeticConfig(_Section):
    num_train: int = Field(20000, ge=1)
    """Training problems generated."""
    num_eval: int = Field(256, ge=1)
    """Held-out problems generated (disjoint from training)."""
    digit_weights: list[float] = [0.20, 0.25, 0.25, 0.22, 0.08]
    """Share of problems with 1, 2, ... columns (digits of the longer operand): a long tail of think lengths."""
    seed: int = 1234
    """Seed of the generated problems (independent of the run seed, so runs share data)."""


class ToolMultiplyConfig(_Section):
    num_train: int = Field(20000, ge=1)
    """Training problems a*b generated."""
    num_eval: int = Field(256, ge=1)
    """Held-out problems (disjoint from training)."""
    digits: tuple[int, int] = (3, 3)
    """Most digits of a and of b (each has at least 2)."""
    seed: int = 1234
    """Seed of the generated problems."""
    chat: bool = False
    """Each prompt as one user chat message that asks for the product and says how to call the tool, rendered by
    a chat model's template (model.path; env.role=tool renders the tool's output as a tool message); else
    `a*b=`, the tiny model's cue."""


class InstructionsConfig(_Section):
    num_train: int = Field(20000, ge=1)
    """Training prompts generated (they may repeat; about 57,000 distinct ones exist)."""
    num_eval: int = Field(256, ge=1)
    """Held-out prompts (distinct, and never a training prompt's text)."""
    constraints: list[str] = list(instructions.CONSTRAINTS)
    """The IFEval instruction ids the prompts draw their constraints from: these eight or a subset (docs/data.md
    says what each asks, with its kwargs)."""
    constraint_weights: list[float] = [1.0, 1.0, 1.0]
    """Share of prompts with 1, 2 and 3 constraints (Prompt.difficulty is the number)."""
    violation_rate: float = Field(0.4, ge=0, le=1)
    """Probability that each constraint of a warm-start demonstration is violated (the answer does what it would
    without it): at 0.4 the demonstrations meet 60% of the constraints, so RL has something to fix."""
    seed: int = 1234
    """Seed of the generated prompts."""
    chat: bool = False
    """Each prompt as one user chat message, rendered by a chat model's template (model.path); else plain text
    ending with a newline, the tiny model's cue to answer."""

    @model_validator(mode="after")
    def _drawable(self) -> InstructionsConfig:
        instructions.check_constraints(self.constraints, self.constraint_weights)
        return self


class TextGameDataConfig(_Section):
    num_train: int = Field(4000, ge=1)
    """Training layouts (prompts) of the built-in text game."""
    num_eval: int = Field(256, ge=1)
    """Held-out layouts (never in training)."""
    rooms: int = Field(4, ge=2, le=8)
    """Rooms per layout."""
    locked_doors: int = Field(1, ge=0, le=3)
    """Locked doors on the way to the goal (each with its key on the near side)."""
    distractors: int = Field(1, ge=0, le=4)
    """Objects that do nothing."""
    seed: int = 1234
    """Seed of the layouts."""


class VisualGridDataConfig(_Section):
    num_train: int = Field(128, ge=1)
    """Training layouts (distinct; a 4x4 grid has 149 in the train split)."""
    num_eval: int = Field(32, ge=1)
    """Held-out layouts (never in training; a 4x4 grid has 43)."""
    size: int = Field(4, ge=2, le=8)
    """Cells a side of the grid (env.options.image_size sets the pictures' pixels)."""
    seed: int = 1234
    """Seed of the layouts."""


class ReasoningGymConfig(_Section):
    tasks: list[str] | dict[str, float] = ["basic_arithmetic"]
    """reasoning-gym task names, equally weighted ([leg_counting, gsm_symbolic]), or name -> weight
    ({basic_arithmetic: 3, leg_counting: 1}): each task's share of the train and held-out prompts."""
    config: dict[str, dict[str, Any]] = {}
    """Per-task generator settings, the fields of the task's reasoning-gym config (seed and size are set here),
    e.g. {basic_arithmetic: {max_terms: 2, max_digits: 2, operators: ["+", "-"]}}; unset fields keep
    reasoning-gym's defaults, which are hard for a small model."""
    num_train: int = Field(10000, ge=1)
    """Training prompts generated (split over the tasks by weight)."""
    num_eval: int = Field(256, ge=1)
    """Held-out prompts drawn from the same generators and settings with another seed, repeats left out
    (kind=reasoning_gym only); training skips every held-out question."""
    seed: int = Field(1234, ge=0)
    """Seed of the generated prompts (independent of the run seed, so runs share data)."""
    instruction: str = 'Give your final answer at the end, after "The answer is".'
    """Appended to every question (GSM8K's too): how to give the answer so that the math verifier finds it."""
    eval_gsm8k: bool = False
    """Also hold out the 100 real GSM8K test problems (data_source gsm8k, reported apart); kind=reasoning_gym."""


class VisionTasksConfig(_Section):
    tasks: list[Literal["count", "tallest", "most"]] = ["count", "tallest", "most"]
    """count: how many shapes of a colour; tallest: which of 4 bars; most: the colour with most shapes."""
    task_weights: list[float] | None = None
    """Each task's share of the prompts (None: equal)."""
    num_train: int = Field(6000, ge=1)
    """Training images (one question each)."""
    num_eval: int = Field(256, ge=1)
    """Held-out images, drawn from another stream."""
    image_size: int = Field(64, ge=16)
    """Side of the drawn images, in pixels."""
    seed: int = 1234
    """Seed of the images (independent of the run seed, so runs share data)."""

    @model_validator(mode="after")
    def _weights_match(self) -> VisionTasksConfig:
        if self.task_weights is not None and (len(self.task_weights) != len(self.tasks)
                                              or min(self.task_weights) < 0 or sum(self.task_weights) <= 0):
            raise ValueError(f"task_weights {self.task_weights}: give one weight >= 0 per task of {self.tasks}, "
                             "not all zero")
        return self


class EnvDataConfig(_Section):
    num_train: int | None = Field(None, ge=1)
    """verifiers: the first N tasks of the taskset (None: all of them, a taskset that ends). openenv: N seeded
    training episodes (None: 1000)."""
    num_eval: int = Field(16, ge=0)
    """Held-out prompts. verifiers: the first of the eval taskset when `eval` is given, else the tasks after the
    training ones. openenv: seeded episodes none of the training ones share."""
    eval: dict[str, Any] | None = None
    """verifiers: overrides of env.options.taskset for the held-out tasks, its eval split (e.g. {split: test})."""
    instruction: str = ("Act in the environment: each observation follows, and each reply of yours is your next "
                        "action.")
    """openenv: each prompt's text (the environment's reset observation follows it)."""
    chat: bool = True
    """openenv: the instruction is a user message, rendered by the model's chat template (false: plain text, for a
    model without one)."""


class DataConfig(_Section):
    kind: Literal["arithmetic", "files", "tool_multiply", "text_game", "instructions", "reasoning_gym",
                  "gsm8k", "vision", "visual_grid", "env"] = "arithmetic"
    """arithmetic: the built-in synthetic task. instructions: the built-in instruction-following task (prompts
    with 1-3 IFEval constraints, for the `ifeval` verifier). files: `train` / `eval` in the common RL format.
    tool_multiply / text_game: the built-in agent tasks (with env.kind=python_tool / text_game). reasoning_gym:
    tasks generated by reasoning-gym (extra `reasoning-gym`), train and held-out from one distribution
    (data.reasoning_gym). gsm8k: train on reasoning-gym's GSM8K-derived gsm_symbolic, hold out the 100 real GSM8K
    test problems (docs/data.md). vision: the built-in visual tasks, images drawn offline (data.vision; a model
    that reads images, e.g. model.tiny.vision). visual_grid: the built-in visual agent task (with
    env.kind=visual_grid and a model that reads images). env: the environment's own tasks (env.kind=verifiers or
    openenv; data.env)."""
    train: str | None = None
    """Training data (.jsonl, .parquet, or a `datasets.save_to_disk` directory) when kind=files."""
    eval: str | None = None
    """Held-out data when kind=files."""
    arithmetic: ArithmeticConfig = ArithmeticConfig()
    """The synthetic task's settings when kind=arithmetic."""
    tool_multiply: ToolMultiplyConfig = ToolMultiplyConfig()
    """The tool task's settings when kind=tool_multiply."""
    text_game: TextGameDataConfig = TextGameDataConfig()
    """The text game's layouts when kind=text_game."""
    instructions: InstructionsConfig = InstructionsConfig()
    """The instruction-following task's settings when kind=instructions."""
    reasoning_gym: ReasoningGymConfig = ReasoningGymConfig()
    """The generated tasks when kind=reasoning_gym (and the training side of kind=gsm8k)."""
    vision: VisionTasksConfig = VisionTasksConfig()
    """The visual tasks when kind=vision."""
    visual_grid: VisualGridDataConfig = VisualGridDataConfig()
    """The visual grid's layouts when kind=visual_grid."""
    env: EnvDataConfig = EnvDataConfig()
    """kind=env: the prompts come from the environment (env.kind=verifiers: its taskset's tasks; openenv: seeded
    episodes, data.env.instruction the prompt); how many, and the held-out ones."""
    max_pixels: int | None = Field(None, ge=1)
    """kind=files: an image of more pixels (width x height) is downscaled to fit, keeping its aspect ratio."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A malformed row stops the run with its file and row number (error) or is skipped and counted."""
    shuffle_seed: int = 0
    """Seed of the per-epoch order of training prompts."""

    @model_validator(mode="after")
    def _files_named(self) -> DataConfig:
        if self.kind == "files" and (self.train is None or self.eval is None):
            raise ValueError("kind=files needs both `train` and `eval` paths (data.train=..., data.eval=...)")
        return self


class EnvConfig(_Section):
    kind: str = "math"
    """math: single-turn answer checking. Multi-turn: python_tool (code in a sandbox), text_game, visual_grid
    (built in; visual_grid shows pictures), textworld, alfworld (extras), or your own class,
    `path/to/my_env.py:MyEnv` (relative to the recipe's directory or the working directory). agent: your own agent
    (env.agent) calls the policy through the OpenAI-compatible endpoint (docs/endpoint.md). verifiers: a Prime
    Intellect `verifiers` environment, its agents calling the policy through the endpoint; openenv: an OpenEnv
    environment, in-process or over its HTTP server (extras; docs/hubs.md)."""
    options: dict[str, Any] = {}
    """Keyword arguments of the environment's constructor; kind verifiers: the environment's own config (its
    `[env]` section: taskset, agent harness and runtime)."""
    max_turns: int = Field(1, ge=1)
    """Most model turns per episode; an episode that uses them all ends with finish reason "turns". If its last
    turn called a tool (the environment's info said tool_call), the verifier does not read it: reason no_answer."""
    reward: Literal["env", "verifier", "both"] = "verifier"
    """env: the environment's summed rewards; verifier: the verifier on the final turn's text; both: the sum."""
    role: Literal["user", "tool"] = "user"
    """Chat prompts: the role observations are rendered as (the template's suffix for one more message)."""
    stop_strings: list[str] = []
    """Strings that end a model turn (besides EOS), e.g. "</code>"; the environment then steps."""
    observation_suffix: str = "\n"
    """Plain-text prompts: appended to each observation (the cue for the next turn)."""
    max_observation_chars: int = Field(4000, ge=16)
    """Longer observations keep their head and say how much was cut."""
    step_timeout_s: float = Field(30.0, gt=0)
    """Deadline of one reset or step; an overrun kills the worker and ends the episode (env_timeout)."""
    min_workers: int = Field(1, ge=1)
    """Environment worker processes kept alive."""
    max_workers: int = Field(4, ge=1)
    """The pool grows to this many when every worker is busy (each one holds many episodes)."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Context kept for an episode's first prompt (the task and the reset observation) on top of
    rollout.max_new_tokens, which every later turn and observation share. None: what the model's context
    leaves after rollout.max_new_tokens, at most 512. An agent's calls: the room its conversation may grow to
    before a call's completion."""
    agent: str | None = None
    """kind agent: `path/to/agent.py:run` or `package.module:run`, an `async def run(client, row)` that gets an
    openai.AsyncOpenAI client bound to the episode and returns its reward (a number), a dict of reward, answer and
    passed, or None (the verifier scores its last reply)."""
    agent_timeout_s: float = Field(600.0, gt=0)
    """Wall deadline of one agent episode (time a pause of the run holds it does not count); an overrun ends it
    with reason agent_timeout, scored 0."""

    @property
    def multi_turn(self) -> bool:
        return self.kind != "math"

    @property
    def is_agent(self) -> bool:
        return self.kind == "agent"

    @property
    def through_endpoint(self) -> bool:
        """Its episodes are agents calling the policy through the endpoint: the user's (agent) or an environment's
        (verifiers)."""
        return self.kind in ("agent", "verifiers")

    @model_validator(mode="after")
    def _agent_named(self) -> EnvConfig:
        if self.is_agent and not self.agent:
            raise ValueError("kind=agent runs your agent: set env.agent=path/to/agent.py:run")
        if self.agent and not self.is_agent:
            raise ValueError(f"env.agent is set but env.kind={self.kind!r}: set env.kind=agent to run it")
        return self


class EndpointConfig(_Section):
    host: str = "127.0.0.1"
    """Address the OpenAI-compatible endpoint binds (loopback by default; any other is reachable by others)."""
    port: int = Field(0, ge=0, le=65535)
    """Its port; 0 takes a free one (endpoint.json in the run directory says which)."""
    api_key: str | None = None
    """The key clients send (Authorization: Bearer ...); None makes a new one per run, in endpoint.json."""
    chat_template: str | None = None
    """The chat template requests are rendered with: None, the tokenizer's; hermes, ChatML with tools and tool
    calls in the Hermes format the endpoint parses (for a ChatML model whose template has none); or a Jinja file."""
    max_pending_calls: int = Field(1024, ge=1)
    """Calls waiting for the engine at once; more are answered 429 (retry later)."""
    serve: bool = False
    """Serve the endpoint in a run without agent tasks too (calls at /v1 use the policy and train nothing); a run
    with an agent task always serves it."""


class SFTConfig(_Section):
    steps: int = Field(400, ge=0)
    """Supervised warm-start steps before RL (0 skips it); only for a model built from scratch."""
    batch_size: int = Field(64, ge=1)
    """Sequences per SFT step."""
    lr: float = Field(1e-3, gt=0)
    """SFT learning rate (AdamW, constant)."""
    carry_drop: float = Field(0.6, ge=0, le=1)
    """Probability that a worked step of the SFT traces drops its carry, so the warm start is imperfect
    (about 50% held-out accuracy) and RL has something to fix."""
    tool_rate: float = Field(0.4, ge=0, le=1)
    """tool_multiply: share of warm-start traces that call the tool (the rest answer mentally)."""
    wrong_code_rate: float = Field(0.3, ge=0, le=1)
    """tool_multiply: share of tool traces whose code computes the wrong thing."""
    expert_error_rate: float = Field(0.3, ge=0, le=1)
    """text_game, visual_grid: probability that a warm-start trace's turn is a wrong action instead of the
    expert's."""
    answer_error_rate: float = Field(0.5, ge=0, le=1)
    """vision: probability that a warm-start answer is another of the task's answers, so the warm start reads the
    image only in part and RL has something to fix."""


class VllmConfig(_Section):
    probe_tolerance: float | None = Field(None, gt=0)
    """After each weight push vLLM's log-probs of a probe row must match flashreinforce's own forward of the
    pushed weights to within this, else the run stops (the push did not take). None: 1e-4 for fp32 rollout
    weights, 5e-2 for bf16 (measured kernel noise: rollout/vllm_engine.py)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """GPU: the share of GPU memory vLLM takes for weights and KV cache (the trainer needs the rest). On CPU the
    KV cache is VLLM_CPU_KVCACHE_SPACE GiB instead (1 unless set)."""
    weight_transfer: Literal["in_process", "nccl", "ipc"] = "in_process"
    """in_process: pushes load into the engine's model in this process (CPU or one GPU), each checked by the
    probe. nccl, ipc: vLLM's native weight-transfer API for engines in other processes; not implemented yet."""


class RolloutConfig(_Section):
    engine: Literal["local", "vllm"] = "local"
    """local: the embedded engine (CPU or GPU). vllm: the vLLM adapter (the vllm extra on GPU; vllm-cpu on CPU,
    docs/vllm.md)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the engine computes: auto is cuda when a GPU is visible (with backend.kind=ray: when the cluster
    has GPUs, each engine actor then asking Ray for one), else cpu."""
    max_batch_size: int = Field(128, ge=1)
    """Engine slots: requests decoded together (continuous batching)."""
    max_new_tokens: int = Field(64, ge=1)
    """Token budget of a response."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature for training rollouts."""
    top_k: int = Field(0, ge=0)
    """Top-k truncation (0 = off)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus truncation (1 = off)."""
    in_flight_updates: bool = True
    """A weight push swaps the engine's weights between two decoding steps and running requests go on
    with their KV cache (as PipelineRL and AReaL do); tokens carry the version that sampled them and the
    importance ratio corrects the rest. False: every push pauses all requests and re-reads their prefixes
    under the new weights (slower: every in-flight prefix is recomputed each step). Checkpoint and
    evaluation steps always pause; april always aborts at a push (that is its method)."""
    fused_decode: Literal["auto", "on", "off"] = "auto"
    """rollout.engine=local on a CPU: decoding steps and prefills of Llama, Mistral and Qwen2 models run their
    norms, rotary embeddings, attention and activations as fused kernels built once with the system's C compiler,
    and their products on weights packed for small batches (log-probs: the model forward's to float rounding in
    fp32, within a bf16 rounding in bf16; docs/components.md#fused-decoding-steps). auto: where the model allows
    and the build succeeds, else the model's own forward; on: an error says why it cannot; off: the model's own
    forward."""
    vllm: VllmConfig = VllmConfig()
    """Options of rollout.engine=vllm (docs/vllm.md)."""

    @field_validator("fused_decode", mode="before")
    @classmethod
    def _on_off_as_yaml_reads_them(cls, value: Any) -> Any:
        """YAML reads a bare on and off (`rollout.fused_decode=off`, `fused_decode: on`) as true and false."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class SchedulerConfig(_Section):
    kind: Literal["stream", "sync", "april", "urb"] = "stream"
    """stream: FlashREINFORCE async; sync: the baseline; april: first-to-finish; urb: unbiased replay buffer."""
    batch_groups: int = Field(128, ge=1)
    """Prompt groups per learner batch (with group_size 1: trajectories per optimizer step)."""
    group_size: int = Field(1, ge=1)
    """Rollouts per prompt: 1 for flashreinforce, >1 for group methods (grpo, rloo, ...)."""
    max_staleness: int = Field(1, ge=0)
    """stream: the most optimizer steps between a token's sampling and its training."""
    stale_policy: Literal["gate", "drop"] = "gate"
    """stream: the learner waits for work about to go over-stale (gate, unbiased, nothing dropped), or
    over-stale work is dropped and its prompt re-queued (drop, favours short rollouts)."""
    buffer_size: int = Field(2, ge=1)
    """urb: N, how many data groups may be in the inference pool at once (N=1 is sync)."""
    over_provision: float = Field(2.0, ge=1)
    """april: groups kept in flight, as a multiple of batch_groups."""
    mask_offpolicy: bool = False
    """april: train only the tokens sampled after a rollout's last resume (slime's
    --mask-offpolicy-in-partial-rollout)."""


class OverlongConfig(_Section):
    max_length: int = Field(..., ge=1)
    """L_max: responses longer than this get reward shaping -1."""
    cache: int = Field(..., ge=1)
    """L_cache: the soft penalty ramps over the last `cache` tokens before max_length."""


class WPSMConfig(_Section):
    tau: float
    """Success rate of a query above which its responses may be flagged well-learned (strict >)."""
    eta: float
    """Mean token entropy below which a response of such a query is flagged (strict <)."""
    alpha: float = Field(1.0, ge=0, le=1)
    """Masked fraction of a flagged response's weight (1 masks it completely)."""
    rate: Literal["query", "group"] = "query"
    """query (ERNIE eq. 4): each prompt's success rate over every rollout of it trained so far (steps, epochs and
    stages, this step's included; kept in checkpoints), so one rollout a prompt works; group: the current group's
    accuracy alone (a departure: with one rollout a prompt, the row's own result)."""
    min_rollouts: int = Field(2, ge=1)
    """rate=query: a prompt with fewer rollouts counted so far is never flagged (one result is not a rate)."""
    positive_only: bool = False
    """Only rows with a positive advantage (within their task, in a mixture) can be flagged, so confident wrong
    answers keep their negative gradient: a departure from eq. 4, which flags right and wrong alike (under a group
    baseline it leaves a mastered group's wrong answers pushing alone)."""


class HintConfig(_Section):
    p_initial: float = Field(..., ge=0, le=1)
    """Fraction of the reference think revealed at step 0."""
    gamma: float = Field(..., ge=0)
    """Decay rate: p_hint = p_initial * exp(-gamma * step * pass_initial)."""
    k: int = Field(4, ge=1)
    """pass@k of the warm-start model that drives each prompt's decay."""
    samples: int = Field(8, ge=1)
    """Samples per training prompt for the unbiased pass@k estimate, drawn once before RL (cost: this many
    generations per training prompt with a reference think)."""
    pass_threshold: float = Field(0.5, ge=0, le=1)
    """Only prompts whose initial pass@k is at most this are hinted."""
    pass_floor: float = Field(0.0, ge=0, le=1)
    """max(pass, floor) in the decay, so prompts the model never solves still anneal (0 = literal)."""
    think_open: str = "<think>"
    """Text that opens the think section, put before the hint when the prompt does not end with it."""

    @model_validator(mode="after")
    def _enough_samples(self) -> HintConfig:
        if self.samples < self.k:
            raise ValueError(f"samples ({self.samples}) must be >= k ({self.k}) to estimate pass@k")
        return self


class AlgoConfig(_Section):
    loss: str = "flashreinforce"
    """Loss by name: flashreinforce, grpo, drgrpo, dapo, gspo, gspo_token, misc, rloo, reinforce++,
    reinforce++-baseline, opd (on-policy distillation from `teachers`)."""
    options: dict[str, Any] = {}
    """Keyword options of the chosen objective (e.g. delta, negative_token_fraction, eps_low, mismatch)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and sample more."""
    overlong: OverlongConfig | None = None
    """DAPO overlong reward shaping (None = off)."""
    wpsm: WPSMConfig | None = None
    """Well-learned positive sample masking (None = off)."""
    hints: HintConfig | None = None
    """Adaptive hint-based RL (None = off)."""

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, value: str) -> str:
        if value not in LOSS_NAMES:
            raise ValueError(f"unknown loss {value!r}: choose one of {', '.join(LOSS_NAMES)}")
        return value


class TeacherConfig(_Section):
    path: str | None = None
    """The teacher model: a local directory, a Hugging Face id (ORG/NAME), the name of a model converted by
    `flashreinforce models get`, or a run of ours (a run or pipeline directory: its final model; a stage's
    directory; a checkpoints/step_* directory), as `flashreinforce eval` takes them."""
    stage: str | None = None
    """Instead of path: the final model of an earlier stage of this pipeline, by name (e.g. an RL expert)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """The teacher's own weights and compute: fp32, or bf16 (its log-softmax is taken in fp32 either way)."""

    @model_validator(mode="after")
    def _one_source(self) -> TeacherConfig:
        if (self.path is None) == (self.stage is None):
            raise ValueError("a teacher names exactly one model: path (a directory, a Hugging Face id, a converted "
                             "model, a run) or stage (an earlier stage of this pipeline)")
        return self


class LoraConfig(_Section):
    r: int = Field(16, ge=1)
    """Rank of each adapter: a linear layer W (out x in) trains B (out x r) @ A (r x in) instead."""
    alpha: float = Field(32.0, gt=0)
    """Scale of the update: W + (alpha / r) * B @ A (alpha / sqrt(r) with rslora)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training. Above 0 the trainer's recomputed log-probs are of a
    dropped-out policy the engine never sampled from, which the mismatch figures and the trust region then
    count as off-policy: keep 0 for RL unless you mean it."""
    target_modules: list[str] | Literal["all-linear"] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"]
    """Linear layers that get an adapter: names matched against each module's full dotted name or its end
    (q_proj matches model.layers.3.self_attn.q_proj), each of which must match at least one linear layer; or
    "all-linear": every linear layer but the output layer and MoE routers/gates. The output layer is never
    adapted. MoE models: routed experts are 3D parameter stacks, not linear layers, and stay frozen (with
    these defaults, attention and the shared expert are adapted)."""
    rslora: bool = False
    """Rank-stabilized scaling alpha / sqrt(r) instead of alpha / r (peft use_rslora)."""
    push: Literal["adapter", "merged"] = "adapter"
    """What a weight push sends the engines: adapter: the base model once per engine, then the adapter alone,
    which each engine merges itself (vLLM applies it as a LoRA request), each push checked by a probe; merged:
    the whole merged model at every push (docs/lora.md)."""

    @field_validator("target_modules", mode="before")
    @classmethod
    def _names_or_all_linear(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "all-linear":
            raise ValueError(f"{value!r} is a single name: give a list of module names (e.g. [q_proj, v_proj]) "
                             "or \"all-linear\"")
        if isinstance(value, list) and (not value or not all(isinstance(n, str) and n for n in value)):
            raise ValueError("name at least one module, each a non-empty string (or use \"all-linear\")")
        return value


class TrainerConfig(_Section):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer computes: auto is cuda when a GPU is visible (with backend.kind=ray: when the cluster
    has GPUs, each trainer rank actor then asking Ray for one), else cpu."""
    world_size: int = Field(1, ge=1)
    """Data-parallel ranks (torch.distributed: gloo on CPU, NCCL on GPU). Every rank gets the whole learner
    batch, normalizes it globally, trains its share of the rows and all-reduces the gradients, so the step
    equals the one-rank step: normalization is global, never per rank."""
    sharding: Literal["replicate", "fsdp"] = "replicate"
    """How the ranks hold the model: replicate (each a full copy of weights, gradients and AdamW state) or fsdp
    (FSDP2: each holds 1/world_size of them, gathered block by block for compute; trainer/sharding.py). The
    step is the same either way. fsdp takes effect with world_size > 1, in every precision (fp8 and the unified
    mode shard fp32 masters beside the formatted weights), with or without LoRA (its frozen base is sharded
    too); a checkpoint resumes only with the sharding it was written by."""
    steps: int = Field(120, ge=0)
    """Optimizer steps of RL (one per learner batch)."""
    lr: float = Field(3e-4, gt=0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps."""
    min_lr_ratio: float = Field(1.0, ge=0, le=1)
    """Cosine decay ends at lr * min_lr_ratio (1.0 = constant after warmup)."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip (math.inf disables it)."""
    microbatch_size: int = Field(64, ge=1)
    """Most rows per forward/backward; gradients accumulate with global normalization."""
    minibatches: int = Field(1, ge=1)
    """Optimizer steps per learner batch (PPO-style mini-batches, as verl's and OpenRLHF's): the batch's prompt
    groups are split into this many parts, each trained as one step against the log-probs the weights had before
    the first (theta_old), so the clip ranges (GSPO's, MISC's, PPO's) act from the second on. Advantages come from
    the whole batch; each part's loss is normalized over its own rows and tokens. The policy version, the weight
    push and the lr schedule advance once a batch."""
    microbatch_tokens: int | None = Field(None, ge=1)
    """Token budget of a microbatch: its rows x longest row (padding included) stays within it; a longer
    row gets a microbatch of its own. The learner batch is sorted by length first, so with a budget short
    rows share a forward and long ones do not pad them (the dynamic batch size of verl and OpenRLHF).
    None: microbatch_size rows each."""
    pack: bool = False
    """Feed the model each microbatch packed, without padding (docs/packing.md): rows of different lengths side by
    side in rows as wide as the batch's longest, each row's positions from 0 and attention masks that keep rows
    apart. Log-probs and losses are the padded path's up to float rounding. A microbatch is then microbatch_size
    packed rows, fewer where microbatch_tokens would be passed by packed rows x width. Where the model cannot be
    packed (it reads images, flash or flex attention, a family not tested packed) a warning says so and it
    trains padded."""
    gradient_checkpointing: bool = False
    """Keep only each decoder layer's input in the forward pass and recompute the layer in the backward pass:
    activation memory of long rows falls to about one layer's, for roughly one more forward of compute. Not
    with trainer.router_replay on an MoE model (the recomputation would not replay the routes)."""
    router_replay: bool = True
    """MoE models: the trainer's forward uses the experts the rollout engine chose for each token and layer
    (rollout router replay, R3), with gate weights from the live router logits; false routes afresh."""
    lora: LoraConfig | None = None
    """LoRA adapters (peft, the lora extra) on the model's linear layers: only they train, the base stays frozen;
    weight pushes carry the adapter alone (trainer.lora.push) and a saved model is the merged full model
    (docs/lora.md). None = full fine-tuning."""
    freeze_vision: bool | None = None
    """A model that reads images: keep its vision encoder's weights as they are (only the LM trains). None: frozen
    for a pretrained model.path, trained for the tiny model built from scratch."""
    checkpoint_every: int = Field(20, ge=0)
    """Optimizer steps between checkpoints (0 = only at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many recent checkpoints to keep on disk."""


class EvalConfig(_Section):
    num_prompts: int = Field(256, ge=1)
    """Held-out prompts evaluated."""
    k: int = Field(4, ge=1)
    """Samples per prompt: avg@k and unbiased pass@k."""
    temperature: float = Field(1.0, gt=0)
    """Evaluation sampling temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Evaluation nucleus truncation."""
    every: int = Field(0, ge=0)
    """Optimizer steps between held-out evaluations during training (0 = only before and after)."""
    greedy: bool = True
    """Also decode each prompt once greedily: eval/greedy_accuracy and eval/distinct_answers (the share of
    distinct greedy answers), which expose a policy that collapsed to one answer while avg@k still rose."""


class VerifierConfig(_Section):
    reward_fn: str | dict[str, Any] = "math"
    """How responses are scored: a registered verifier by name (math, choice, exact, regex, format, code,
    ifeval, ...), or {kind: NAME, options...}, a route by data_source, a weighted sum (docs/verifiers.md); or a
    user function "path/file.py:fn" / "package.module:fn"."""

    @field_validator("reward_fn")
    @classmethod
    def _known_verifier(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        return checked_verifier(value)
    timeout_s: float = Field(5.0, gt=0)
    """Wall-clock limit per verifier call; a call over it scores 0 with reason "timeout". A batch of a batchable
    verifier (reward_model, judge: `batch_size` rows at once) shares one limit: raise it for a large model."""
    min_workers: int = Field(1, ge=0)
    """Verifier processes kept alive."""
    max_workers: int = Field(2, ge=1)
    """Verifier processes the pool may grow to while CPUs are idle."""
    memory_limit_mb: int | None = Field(4096, ge=64)
    """Address-space cap of each verifier process: a reward that allocates past it scores 0 with reason
    "crash: ..." instead of swapping the machine (None = no cap)."""


class BackendConfig(_Section):
    kind: Literal["local", "ray"] = "local"
    """local: one process (asyncio + a generation thread). ray: actors on a Ray cluster (the ray extra)."""
    address: str | None = None
    """ray: None starts a local Ray on this machine; "auto" joins the running cluster (`ray start --head` on
    one machine, `ray start --address=<head>:6379` on the others); or a cluster address."""
    num_engines: int = Field(1, ge=1)
    """ray: rollout engine actors; requests go to the least loaded one."""
    health_timeout_s: float = Field(60.0, gt=0)
    """ray: an actor that does not answer a health check or a call within this long is treated as dead
    (restarted, its requests re-queued), never waited on forever."""
    weight_sync: Literal["auto", "object_store", "broadcast"] = "auto"
    """ray: how new weights reach the engines. object_store: rank 0's weights on its CPU, once in Ray's object
    store, each engine copies them out. broadcast: one torch.distributed broadcast from rank 0 to every engine
    (NCCL when the trainer and the engines are all on cuda, else gloo), falling back to the object store for an
    engine it does not reach. auto: broadcast when both sides are on cuda, else object_store."""
    step_timeout_s: float = Field(3600.0, gt=0)
    """ray: the longest a trainer call (an optimizer step, a checkpoint's trainer state) may take before its rank
    is treated as hung: the run stops with an error, and `flashreinforce train --resume <run_dir>` continues it."""
    torch_threads: int = Field(1, ge=1)
    """Intra-op torch threads. In the overlapped loop the engine thread and the trainer each run kernels
    with this many, so one each fills a 2-core machine; more oversubscribes the cores (the run warns): OpenMP
    then stops keeping its idle threads awake, which makes a bf16 trainer step ~10-15% slower on an idle
    machine, and other processes competing make it several-fold (measured: an SFT step 0.15 s at 1 thread,
    2.8 s at 2 threads with other jobs running). Lockstep (deterministic: true) computes on one thread at a
    time, so it can take every core."""
    trainer_process: bool = False
    """Overlapped loop: run the trainer in a process of its own (trainer/process.py), so its step does not
    take turns at the GIL with the decoding thread. It costs a few seconds of start-up and the child's own
    torch in memory. Measured on 2 cores: the schedulers benchmark's long-tailed workload runs urb and
    stream ~8% faster with it (4 of 4 alternating runs), the default recipe not (RL time 98 s vs 95 s), so it
    is off by default. The lockstep loop (`deterministic: true`) always trains inline."""

    @model_validator(mode="after")
    def _ray_only(self) -> BackendConfig:
        if self.weight_sync == "broadcast" and self.kind != "ray":
            raise ValueError("backend.weight_sync=broadcast sends weights to Ray engine actors: set backend.kind=ray, "
                             "or leave backend.weight_sync=auto (the local backend's engine shares the trainer's "
                             "process and copies the weights in memory)")
        return self


class LogConfig(_Section):
    tensorboard: bool = True
    """Write TensorBoard event files next to metrics.jsonl."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb extra and a login)."""
    samples_per_step: int = Field(2, ge=0)
    """Decoded trajectories written to samples.jsonl per optimizer step."""
    progress: bool = True
    """Show the live progress bar."""


class TaskSamplingConfig(_Section):
    max_new_tokens: int | None = Field(None, ge=1)
    """This task's response budget (None: rollout.max_new_tokens)."""
    temperature: float | None = Field(None, gt=0)
    """This task's sampling temperature (None: rollout.temperature); the trainer recomputes each row's log-probs
    at its task's temperature."""
    top_p: float | None = Field(None, gt=0, le=1)
    """This task's nucleus sampling (None: rollout.top_p)."""
    top_k: int | None = Field(None, ge=0)
    """This task's top-k (None: rollout.top_k)."""


TASK_NAME = r"^[A-Za-z][A-Za-z0-9_-]*$"


class TaskConfig(_Section):
    weight: float = Field(1.0, gt=0)
    """Share of the training prompts: a task of weight 3 beside one of weight 1 gives 3 of every 4 prompts."""
    data: DataConfig
    """The task's prompts, as the run's `data` section says them (kind, files, generator settings)."""
    env: EnvConfig = EnvConfig()
    """How an episode of this task runs: single-turn (kind math) or an environment, as the run's `env`."""
    verifier: str | dict[str, Any] = "math"
    """How its responses are scored: a registered verifier by name, {kind: NAME, options...}, a route by
    data_source ({route: {gsm8k: math, ifeval: ifeval}}), a weighted sum, or a user function "file.py:fn"
    (docs/verifiers.md). Ignored with env.reward=env."""

    @field_validator("verifier")
    @classmethod
    def _known_verifier(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        return checked_verifier(value)
    rollout: TaskSamplingConfig = TaskSamplingConfig()
    """This task's sampling overrides (max_new_tokens, temperature, top_p, top_k)."""
    modality: str | None = None
    """The modality of its prompts (per-modality metrics; MISC's bands). None: each prompt's own (image for a
    prompt with images, else text, unless its data row says)."""


STAGE_SECTIONS = ("tasks", "data", "env", "verifier", "sft", "rollout", "scheduler", "algo", "trainer", "eval",
                  "precision", "log", "teachers")
"""The run config sections a stage may override; the model, seed, backend and mode are the run's own."""


class StageConfig(_Section):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    name: str
    """Names the stage's directory (stages/NN-<name>), its metrics rows and its summary entry."""
    steps: int = Field(ge=1)
    """Optimizer steps of the stage: RL steps, or SFT steps for kind sft."""
    kind: Literal["rl", "sft", "distill"] = "rl"
    """rl: the run's RL loop under the stage's config; sft: the warm start's SFT on the stage's tasks'
    demonstrations (built-in tasks: of the tiny model, or of model.path's, chat templates included); distill:
    the RL loop under on-policy distillation (algo.loss=opd), each task's rows scored by its teacher
    (`teachers`). Each on the weights the previous stage left, or `from`'s."""
    start: str | None = Field(None, alias="from")
    """`from: NAME`: start from the final weights of that earlier stage instead of the previous one's (several
    stages `from` the same one train side by side from one start, each its own weights). None: the previous
    stage's."""
    optimizer: Literal["keep", "reset"] = "keep"
    """keep: AdamW's moments carry over from the previous RL stage (its learning rate and schedule do not: each
    stage has its own); reset: a fresh AdamW. After an sft stage, or in the first stage, there are none to keep."""
    tasks: dict[str, dict[str, Any]] | None = None
    """The tasks this stage trains, by name: a name of the recipe's `tasks` takes its definition, with what is
    given here merged over it ({} for as it is); a new name is a whole task definition. None: the recipe's."""
    data: dict[str, Any] | None = None
    """Overrides of the run's `data` (a run without `tasks`)."""
    env: dict[str, Any] | None = None
    """Overrides of the run's `env` (a run without `tasks`)."""
    verifier: dict[str, Any] | None = None
    """Overrides of the run's `verifier`."""
    sft: dict[str, Any] | None = None
    """Overrides of the run's `sft` (batch_size, lr... of an sft stage)."""
    rollout: dict[str, Any] | None = None
    """Overrides of the run's `rollout`."""
    scheduler: dict[str, Any] | None = None
    """Overrides of the run's `scheduler`."""
    algo: dict[str, Any] | None = None
    """Overrides of the run's `algo` (loss, options, hints...)."""
    trainer: dict[str, Any] | None = None
    """Overrides of the run's `trainer` (lr, warmup_steps...; steps is the stage's)."""
    eval: dict[str, Any] | None = None
    """Overrides of the run's `eval`."""
    precision: dict[str, Any] | None = None
    """Overrides of the run's `precision` (a stage's numerics: precision.mode=unified with bf16...)."""
    log: dict[str, Any] | None = None
    """Overrides of the run's `log`."""
    teachers: dict[str, dict[str, Any]] | None = None
    """Overrides of the run's `teachers` (a distill stage's, by task: {TASK: {stage: NAME}})."""


class RunConfig(_Section):
    name: str = "run"
    """Recipe name; the default run directory is runs/<name>-<timestamp>."""
    seed: int = 0
    """Seed of model init, sampling and data order."""
    deterministic: bool = False
    """Step generation, verification and training in lockstep so a run (and a killed-and-resumed run)
    is bitwise reproducible; slower than the overlapped default."""
    model: ModelConfig = ModelConfig()
    precision: PrecisionConfig = PrecisionConfig()
    data: DataConfig = DataConfig()
    env: EnvConfig = EnvConfig()
    sft: SFTConfig = SFTConfig()
    rollout: RolloutConfig = RolloutConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    algo: AlgoConfig = AlgoConfig()
    trainer: TrainerConfig = TrainerConfig()
    eval: EvalConfig = EvalConfig()
    verifier: VerifierConfig = VerifierConfig()
    backend: BackendConfig = BackendConfig()
    log: LogConfig = LogConfig()
    endpoint: EndpointConfig = EndpointConfig()
    tasks: dict[str, TaskConfig] | None = None
    """A mixture of tasks trained in one run (docs/tasks.md): name -> {weight, data, env, verifier, rollout,
    modality}. Training prompts interleave by weight, each scored by its own verifier, with metrics and held-out
    scores per task. None: one task, from the run's data, env and verifier sections."""
    teachers: dict[str, TeacherConfig] | None = None
    """On-policy distillation's frozen teachers (algo.loss=opd), by task: each task's rows are scored by its
    teacher ({TASK: {path: DIR}}; `all` for every task not named, and for a run without tasks). A teacher must
    share the student's vocabulary. Used by opd only."""
    stages: list[StageConfig] | None = None
    """A pipeline run in order on the same weights (docs/stages.md): each stage a name, steps, kind (rl, sft or
    distill), where it starts (from), optimizer (keep or reset) and overrides of the sections in STAGE_SECTIONS,
    deep-merged over the rest of the recipe. None: one stage, the recipe itself."""

    @model_validator(mode="after")
    def _tasks_alone(self) -> RunConfig:
        if self.tasks is None:
            return self
        if not self.tasks:
            raise ValueError("tasks: empty; give at least one task, or leave tasks out for a one-task run")
        for name in self.tasks:
            if not re.match(TASK_NAME, name) or name in RESERVED_TASK_NAMES:
                raise ValueError(f"tasks.{name}: a task name is a letter, then letters, digits, _ or - (it names "
                                 f"metrics task/<name>/...), and not one of {sorted(RESERVED_TASK_NAMES)}")
        # Compared with the defaults, not by whether they were given: a run's saved config.yaml spells them out.
        shadowed = [name for name, default in (("data", DataConfig()), ("env", EnvConfig()))
                    if getattr(self, name) != default]
        if shadowed:
            raise ValueError(f"tasks: and the run's {' and '.join(shadowed)} section both given; with tasks, each "
                             f"task has its own (tasks.<name>.{shadowed[0]}): move it into the tasks")
        return self

    @model_validator(mode="after")
    def _stages_build(self) -> RunConfig:
        """Every stage's config is built (and so checked) at load, not when the run reaches it."""
        if self.stages is None:
            return self
        if not self.stages:
            raise ValueError("stages: empty; give at least one stage, or leave stages out for a one-stage run")
        names = [stage.name for stage in self.stages]
        for index, name in enumerate(names):
            if not re.match(TASK_NAME, name) or name in names[:index]:
                raise ValueError(f"stages[{index}].name={name!r}: a stage name is unique, a letter, then letters, "
                                 "digits, _ or - (it names the stage's directory)")
        for index in range(len(self.stages)):
            stage = self.stage(index)
            _check_stage_sources(index, self.stages[index], stage, names)
            if self.stages[index].kind != "sft":
                continue
            for task_name, task in stage.task_list():
                if task.data.kind in UNDEMONSTRATED_KINDS:
                    where = f"tasks.{task_name}." if task_name else ""
                    raise ValueError(f"stages[{index}] ({names[index]}): kind sft trains the built-in tasks' "
                                     f"demonstrations, and {where}data.kind={task.data.kind} has none: make it an rl "
                                     "stage, or fine-tune on your data elsewhere and start from it (model.path)")
        return self

    def stage(self, index: int) -> RunConfig:
        """The config stage `index` runs under: the recipe without `stages`, the stage's sections deep-merged over
        it (its `tasks` chosen by name from the recipe's; with another `algo.loss`, only its own `algo.options`),
        and its steps as trainer.steps (sft.steps for sft). A distill stage trains with algo.loss=opd; a stage whose
        loss is not opd has no teachers (a recipe's may be meant for its distill stages)."""
        stage = self.stages[index]
        tree = self.model_dump(mode="json", exclude={"stages"})
        for section in STAGE_SECTIONS:
            given = getattr(stage, section)
            if section == "algo" and stage.kind == "distill":
                if (given or {}).get("loss", "opd") != "opd":
                    raise ValueError(f"stages[{index}] ({stage.name}): kind distill trains with algo.loss=opd, and it "
                                     f"names algo.loss={given['loss']}: make it an rl stage, or leave its loss out")
                given = {**(given or {}), "loss": "opd"}
            if given is None:
                continue
            if section == "tasks":
                catalogue = tree.get("tasks") or {}
                for name in given:
                    if name not in catalogue and "data" not in (given[name] or {}):
                        raise ValueError(f"stages[{index}] ({stage.name}): tasks.{name} is not one of the recipe's "
                                         f"tasks ({', '.join(catalogue) or 'none'}){did_you_mean(name, catalogue)}; "
                                         f"a new task needs its own data (tasks.{name}.data)")
                tree["tasks"] = {name: _merge(catalogue.get(name, {}), override or {}) for name, override in given.items()}
            elif section == "algo" and given.get("loss", tree["algo"]["loss"]) != tree["algo"]["loss"]:
                # Options belong to a loss (FlashREINFORCE's baseline means nothing to MISC): another loss starts
                # from its own defaults and the options the stage gives.
                tree["algo"] = _merge({**tree["algo"], "options": {}}, given)
            else:
                tree[section] = _merge(tree[section] or {}, given)
        tree["sft" if stage.kind == "sft" else "trainer"]["steps"] = stage.steps
        if tree["algo"]["loss"] != "opd":
            tree["teachers"] = None
        try:
            return RunConfig.model_validate(tree)
        except ValidationError as error:
            problems = format_validation_error(error).splitlines()[1:]  # past its "invalid config:" line
            raise ValueError(f"stages[{index}] ({stage.name}), merged over the recipe: "
                             + "; ".join(problem.strip() for problem in problems)) from None

    def task_list(self) -> list[tuple[str, TaskConfig]]:
        """The run's tasks in order; without `tasks`, the one task of the data, env and verifier sections, named
        "" (its prompts keep their ids and it reports no task/ metrics)."""
        if self.tasks is not None:
            return list(self.tasks.items())
        return [("", TaskConfig(data=self.data, env=self.env, verifier=self.verifier.reward_fn))]

    def for_task(self, name: str) -> RunConfig:
        """The run's config as one task sees it: its data, env and verifier in the run's sections, its sampling
        overrides applied to rollout (the builders of the one-task run take it as it is)."""
        task = dict(self.task_list())[name]
        overrides = {k: v for k, v in task.rollout.model_dump().items() if v is not None}
        return self.model_copy(update={
            "data": task.data, "env": task.env, "tasks": None,
            "verifier": self.verifier.model_copy(update={"reward_fn": task.verifier}),
            "rollout": self.rollout.model_copy(update=overrides)})

    @model_validator(mode="after")
    def _environment_prompts(self) -> RunConfig:
        """data.kind=env takes the prompts from an environment that has them; a verifiers environment's tasks come
        from nowhere else, and its rubric scores them."""
        for name, task in self.task_list():
            where, kind = f"tasks.{name}." if name else "", task.env.kind
            if task.data.kind == "env" and kind not in ("verifiers", "openenv"):
                raise ValueError(f"{where}data.kind=env takes the prompts from the environment: set {where}env.kind="
                                 f"verifiers or openenv (it is {kind!r})")
            if kind == "verifiers" and task.data.kind != "env":
                raise ValueError(f"{where}env.kind=verifiers trains on its environment's tasks: set {where}data.kind=env "
                                 f"(it is {task.data.kind})")
            if kind == "verifiers" and task.env.reward != "env":
                raise ValueError(f"{where}env.kind=verifiers is scored by its environment's rubric: set "
                                 f"{where}env.reward=env (it is {task.env.reward})")
        return self

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        for name, task in self.task_list():
            where = f"tasks.{name}." if name else ""
            if self.model.path is None and task.data.kind in UNDEMONSTRATED_KINDS:
                raise ValueError(f"model.path is required with {where}data.kind={task.data.kind} (the built-in tiny "
                                 "model only knows the built-in tasks' tokenizers), e.g. model.path=smollm2-135m-instruct "
                                 "after `flashreinforce models get smollm2-135m-instruct`")
            for kind in ("instructions", "tool_multiply"):
                if self.model.path is None and task.data.kind == kind and getattr(task.data, kind).chat:
                    raise ValueError(f"{where}data.{kind}.chat=true renders prompts with a chat model's template: "
                                     "set model.path to a chat model, or chat=false for the built-in tiny model")
            task_env = {"tool_multiply": "python_tool", "text_game": "text_game",
                        "visual_grid": "visual_grid"}.get(task.data.kind)
            if task_env is not None and task.env.kind not in (task_env, "agent"):  # agent: the user's own plays it
                raise ValueError(f"{where}data.kind={task.data.kind} is an agent task: set {where}env.kind={task_env} "
                                 f"or agent, with an agent of your own (it is {task.env.kind!r})")
            if task.data.kind == "visual_grid" and self.model.path is None and self.model.tiny.vision is None:
                raise ValueError(f"{where}data.kind=visual_grid shows pictures: give the tiny model an encoder "
                                 "(model.tiny.vision={}) or set model.path to a vision-language model")
        # With one rollout per prompt a group baseline makes every advantage exactly zero: refuse it loudly.
        if self.algo.loss not in SINGLE_ROLLOUT_LOSSES and self.scheduler.group_size == 1:
            raise ValueError(f"algo.loss={self.algo.loss} compares rollouts of the same prompt: set "
                             f"scheduler.group_size >= 2 (or use one of {sorted(SINGLE_ROLLOUT_LOSSES)})")
        # A group of one always has a constant reward, so dynamic sampling would drop every group and never train.
        if self.algo.dynamic_sampling and self.scheduler.group_size == 1:
            raise ValueError("algo.dynamic_sampling=true keeps only groups whose rewards differ, and with "
                             "scheduler.group_size=1 no group can: set scheduler.group_size >= 2 or "
                             "algo.dynamic_sampling=false")
        return self

    @model_validator(mode="after")
    def _teachers_for_opd(self) -> RunConfig:
        """opd scores every task's rows with a teacher: each task has one (its own or `all`), and nothing else does.
        A pipeline's recipe is checked stage by stage, as each stage's config is built."""
        if self.stages is not None:
            return self
        teachers = self.teachers or {}
        if self.algo.loss != "opd":
            if teachers:
                raise ValueError(f"teachers: only on-policy distillation uses them (algo.loss=opd, or a stage of kind "
                                 f"distill), and algo.loss={self.algo.loss}: set algo.loss=opd, or leave teachers out")
            return self
        tasks = [name for name, _ in self.task_list()]
        unknown = sorted(set(teachers) - set(tasks) - {"all"})
        if unknown:
            known = f"its tasks ({', '.join(tasks)}) or all" if self.tasks else "all (a run without tasks has one)"
            raise ValueError(f"teachers.{unknown[0]}: a teacher is named by the task it scores: "
                             f"{known}{did_you_mean(unknown[0], [*tasks, 'all'])}")
        missing = [name for name in tasks if name not in teachers and "all" not in teachers]
        if missing:
            who, where = (f"task {missing[0]}", f"teachers.{missing[0]}") if missing[0] else ("the run", "teachers.all")
            raise ValueError(f"algo.loss=opd scores each task's rows with its teacher, and {who} has none: give "
                             f"{where}: {{path: DIR}} (a model or a run; stage: NAME in a pipeline)")
        return self

    @model_validator(mode="after")
    def _wpsm_can_flag(self) -> RunConfig:
        """WPSM with positive_only and the group rate flags positive rows of groups whose accuracy passes tau. Under a
        group baseline an all-correct group's advantages are 0, so some group of G with accuracy in (tau, 1) must
        exist."""
        wpsm, size = self.algo.wpsm, self.scheduler.group_size
        if (wpsm is not None and wpsm.positive_only and wpsm.rate == "group"
                and self.algo.loss not in SINGLE_ROLLOUT_LOSSES and (size - 1) / size <= wpsm.tau):
            raise ValueError(f"algo.wpsm can never flag a row: with algo.loss={self.algo.loss} a group of "
                             f"scheduler.group_size={size} whose accuracy passes tau={wpsm.tau} is all correct, "
                             f"and its advantages are 0; raise group_size above {1 / (1 - wpsm.tau):g} or lower tau")
        return self


def _check_stage_sources(index: int, stage: StageConfig, config: RunConfig, names: list[str]) -> None:
    """A stage's `from` and its teachers' `stage:` name earlier stages of the pipeline."""
    earlier = names[:index]
    ran = ", ".join(earlier) or "none before it"
    if stage.start is not None and stage.start not in earlier:
        raise ValueError(f"stages[{index}] ({stage.name}): from={stage.start!r} names no earlier stage (a stage starts "
                         f"from one that has run: {ran}){did_you_mean(stage.start, earlier)}")
    for task, teacher in (config.teachers or {}).items():
        if teacher.stage is not None and teacher.stage not in earlier:
            raise ValueError(f"stages[{index}] ({stage.name}): teachers.{task}.stage={teacher.stage!r} names no "
                             f"earlier stage (a teacher is a stage that has run: {ran})"
                             f"{did_you_mean(teacher.stage, earlier)}")


def resolve_recipe(recipe: str | None) -> Path:
    """A recipe name from flashreinforce/recipes, or a path to a YAML file."""
    if recipe is None:
        recipe = DEFAULT_RECIPE
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ValueError(f"recipe file {path} does not exist")
        return path
    path = RECIPES_DIR / f"{recipe}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown recipe {recipe!r}{did_you_mean(recipe, shipped_recipes())}; shipped recipes: "
                         f"{', '.join(shipped_recipes())} (or pass a path to a .yaml file)")
    return path


def shipped_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    """" (did you mean 'lr'?)" for a close match among `choices`, else ""."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_override(text: str) -> tuple[list[str], Any]:
    """"trainer.lr=1e-5" -> (["trainer", "lr"], 1e-05). Values are YAML scalars/flow collections."""
    if "=" not in text:
        raise ValueError(f"override {text!r} is not of the form dotted.field=value")
    dotted, raw = text.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(keys):
        raise ValueError(f"override {text!r} has an empty field name")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as error:
        raise ValueError(f"override {text!r}: value is not valid YAML ({error})") from None
    if isinstance(value, str) and value.lower() in ("inf", "+inf", "-inf", "1e9999"):
        value = float(value)  # YAML spells infinity ".inf"; accept the way people type it too
    return keys, value


def _set_dotted(tree: dict[str, Any], keys: list[str], value: Any) -> None:
    """tree[k1][k2]... = value; a numeric key indexes a list (`stages.1.steps=40`), a missing section is made."""
    node: Any = tree
    for depth, key in enumerate(keys):
        parent = ".".join(keys[:depth])
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ValueError(f"override {'.'.join(keys)}: {parent} is a list of {len(node)}: index it with "
                                 f"0 to {len(node) - 1}, not {key!r}")
            key = int(key)
        elif not isinstance(node, dict):
            raise ValueError(f"override {'.'.join(keys)}: {parent} is a value, not a section")
        if depth == len(keys) - 1:
            node[key] = value
            return
        if isinstance(node, dict) and node.get(key) is None:
            node[key] = {}
        node = node[key]


def format_validation_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")  # a validator's own message says what is wrong
        if item["type"] == "extra_forbidden":
            section, fields = _section_at(item["loc"][:-1])
            message = (f"unknown field{did_you_mean(str(item['loc'][-1]), fields)}; "
                       f"`{f'flashreinforce config {section}'.strip()}` lists the fields with their docs")
        lines.append(f"  {field}: {message}" if field else f"  {message}")  # a whole-config check names its fields
    return "invalid config:\n" + "\n".join(lines)


def _section_at(loc: tuple[Any, ...]) -> tuple[str, list[str]]:
    """The config section at a validation error's location, as `flashreinforce config` names it (a task's or a
    stage's fields under tasks, stages), and its field names ([] where the location is no section)."""
    annotation: Any = RunConfig
    names: list[str] = []
    for part in loc:
        annotation = _unwrap_optional(annotation)
        if typing.get_origin(annotation) in (dict, list):
            annotation = typing.get_args(annotation)[-1]  # `part` is a task name or a stage's index
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel) and part in annotation.model_fields:
            annotation = annotation.model_fields[part].annotation
            names.append(part)
        else:
            return ".".join(names), []
    annotation = _unwrap_optional(annotation)
    is_section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return ".".join(names[:1] if len(names) < len(loc) else names), list(annotation.model_fields) if is_section else []


def _unwrap_optional(annotation: Any) -> Any:
    """X for `X | None`, else the annotation as it is."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    optional = typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1
    return args[0] if optional else annotation


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_recipe(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe's YAML tree, with `inherit: <recipe>` resolved (the child's values win, sections merge)."""
    if path in _seen:
        raise ValueError(f"recipe {path} inherits from itself (via {' -> '.join(map(str, _seen))})")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"recipe {path} is not valid YAML: {error}") from None
    if not isinstance(tree, dict):
        raise ValueError(f"recipe {path} must be a mapping of sections, got {type(tree).__name__}")
    parent = tree.pop("inherit", None)
    if parent is None:
        return tree
    return _merge(read_recipe(resolve_recipe(str(parent)), (*_seen, path)), tree)


def load_config(recipe: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Recipe YAML + dotted overrides -> a validated RunConfig, or ValueError naming the field."""
    return config_from_tree(read_recipe(resolve_recipe(recipe)), overrides)


def config_from_tree(tree: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A parsed YAML tree (a recipe, or a run's saved config.yaml) + dotted overrides -> a validated RunConfig."""
    for text in overrides:
        keys, value = parse_override(text)
        tasks = tree.get("tasks")
        # A misspelt task, not a new one given field by field:
        if (len(keys) > 2 and keys[0] == "tasks" and isinstance(tasks, dict) and keys[1] not in tasks
                and (hint := did_you_mean(keys[1], tasks))):
            raise ValueError(f"override {text!r}: the recipe has no task {keys[1]!r}{hint}; its tasks: "
                             f"{', '.join(tasks)}")
        _set_dotted(tree, keys, value)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as error:
        raise ValueError(format_validation_error(error)) from None


def dump_config(config: RunConfig) -> str:
    data = config.model_dump(mode="json", by_alias=True)
    return yaml.safe_dump(data, sort_keys=False)
