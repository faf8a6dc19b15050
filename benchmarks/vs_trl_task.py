"""What every vs-trl run shares: the settings, the cached warm start, the held-out scorer, the records.

Both frameworks start from one warm-start directory (our SFT, saved in Hugging Face format with the char
tokenizer) and are scored by one held-out evaluation (our `evaluate` on our engine, avg@k at T=1 on the
same prompts with the same per-sample seeds). This module runs nothing by itself and does not import TRL.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RECIPES = {"flashreinforce": "arithmetic", "grpo": "arithmetic_grpo", "flashreinforce-sync": "arithmetic_sync"}
"""Our methods are the shipped recipes: FlashREINFORCE (128 prompts x 1) and GRPO (32 prompts x 4), both
overlapped (the engine one step ahead of the trainer), and FlashREINFORCE in turns (the `sync` scheduler: every
batch sampled by the weights it trains; an ablation of the overlap, run on request)."""
ONE_ROLLOUT = ("flashreinforce", "flashreinforce-sync")
TRL_METHODS = ("trl", "trl-all-cores")
"""TRL's GRPOTrainer with `model.generate` (of TRL's configurations, vs_trl_routes.py tries each on this machine):
at the threads every run gets, and at all the machine's cores (torch's default, which TRL keeps)."""
METHODS = (*RECIPES, *TRL_METHODS)
DEFAULT_METHODS = ("flashreinforce", "grpo", *TRL_METHODS)


@dataclass(frozen=True)
class Settings:
    """One benchmark's knobs; every run of it (method x seed) uses all of them."""

    steps: int
    """Optimizer steps per run (the cap; time to threshold is read off the eval curve)."""
    max_seconds: float
    """RL wall-clock cap per run, evaluation excluded (TRL stops there; ours is capped by steps)."""
    threshold: float
    """Held-out avg@k (percent) whose first crossing is timed."""
    eval_every: int
    """Optimizer steps between held-out evaluations."""
    eval_prompts: int
    eval_k: int
    trajectories: int
    """Trajectories per optimizer step: FlashREINFORCE takes this many prompts x 1."""
    group_size: int
    """GRPO (ours and TRL): trajectories / group_size prompts x group_size."""
    max_new_tokens: int
    lr: float
    grad_clip: float
    threads: int
    """torch intra-op threads in every run but trl-all-cores's training, and in every held-out evaluation."""
    all_cores: int
    """torch intra-op threads of trl-all-cores's generation and training: the cores this process may use."""
    sft_steps: int
    """Steps of the shared SFT warm start."""
    precision: str = "fp32"
    """Every run's compute precision, generation and training; weights and AdamW stay fp32 in all (ours: fp32
    masters of bf16 weights; TRL: `bf16=True`, autocast over its fp32 model). The warm start is fp32 SFT."""

    def __post_init__(self) -> None:
        if self.steps % self.eval_every:
            raise ValueError(f"--steps {self.steps} must be a multiple of --eval-every {self.eval_every}, "
                             "so every run ends on an evaluation")
        if self.trajectories % self.group_size:
            raise ValueError(f"--trajectories {self.trajectories} must be a multiple of the group size "
                             f"{self.group_size}")

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    def trl_threads(self, method: str) -> int:
        """The torch threads a TRL method generates and trains with (its held-out evaluation keeps `threads`)."""
        return self.all_cores if method == "trl-all-cores" else self.threads

    def label(self, method: str) -> str:
        """How the table names a method, with its prompts x rollouts per optimizer step (and TRL's threads)."""
        groups = f"{self.trajectories // self.group_size}x{self.group_size}"
        if method in TRL_METHODS:
            threads = self.trl_threads(method)
            return f"TRL GRPOTrainer ({groups}, {threads} thread{'s' if threads > 1 else ''})"
        return {"flashreinforce": f"ours: FlashREINFORCE ({self.trajectories}x1, async)",
                "grpo": f"ours: GRPO ({groups}, async)",
                "flashreinforce-sync": f"ours: FlashREINFORCE ({self.trajectories}x1, sync)"}[method]


def task_overrides(settings: Settings) -> list[str]:
    """Overrides of the default recipe shared by every run: the warm start, threads, held-out evaluation."""
    return [
        f"sft.steps={settings.sft_steps}",
        f"backend.torch_threads={settings.threads}",
        f"rollout.max_new_tokens={settings.max_new_tokens}",
        f"eval.num_prompts={settings.eval_prompts}",
        f"eval.k={settings.eval_k}",
        "eval.temperature=1.0",
        "eval.top_p=1.0",
    ]


def precision_overrides(settings: Settings) -> list[str]:
    """Our runs' precision, and every held-out evaluation's: the engine's and the trainer's."""
    return [f"precision.trainer={settings.precision}", f"precision.rollout={settings.precision}"]


def our_overrides(method: str, settings: Settings, seed: int, warm_dir: Path) -> list[str]:
    """`flashreinforce train RECIPE ...` overrides for one of our runs: every shared knob set explicitly."""
    groups, size = ((settings.trajectories, 1) if method in ONE_ROLLOUT
                    else (settings.trajectories // settings.group_size, settings.group_size))
    return [
        *task_overrides(settings),
        *precision_overrides(settings),
        f"model.path={warm_dir}",
        f"seed={seed}",
        f"data.shuffle_seed={seed}",
        f"scheduler.batch_groups={groups}",
        f"scheduler.group_size={size}",
        "rollout.temperature=1.0",
        "rollout.top_k=0",
        "rollout.top_p=1.0",
        f"trainer.steps={settings.steps}",
        f"trainer.lr={settings.lr}",
        "trainer.warmup_steps=0",
        "trainer.min_lr_ratio=1.0",  # constant learning rate
        "trainer.weight_decay=0.0",
        f"trainer.grad_clip={settings.grad_clip}",
        "trainer.checkpoint_every=0",  # only the final checkpoint, after the last measured step
        f"eval.every={settings.eval_every}",
        "log.tensorboard=false",  # TRL runs with report_to="none"
        "log.samples_per_step=0",
        "log.progress=false",
    ]


def warm_start(settings: Settings, out: Path, python: str) -> Path:
    """The SFT warm start in Hugging Face format, built once per task settings with `flashreinforce sft`."""
    from flashreinforce.config import load_config

    config = load_config(RECIPES["flashreinforce"], task_overrides(settings))
    # Everything that shapes the warm start: the model, its SFT and the data it is trained on.
    key = json.dumps({k: config.model_dump(mode="json")[k] for k in ("seed", "model", "sft", "data")}, sort_keys=True)
    directory = out / f"warm-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if not (directory / "sft" / "config.json").is_file():
        print(f"building the warm start ({settings.sft_steps} SFT steps) in {directory}", flush=True)
        subprocess.run([python, "-m", "flashreinforce", "sft", "--output", str(directory),
                        RECIPES["flashreinforce"], *task_overrides(settings), "log.progress=false"],
                       check=True, stdout=subprocess.DEVNULL)
    return directory / "sft"


@dataclass(frozen=True)
class EvalPoint:
    step: int
    seconds: float
    """RL wall-clock since the first step began, held-out evaluation time excluded."""
    sampled_tokens: int
    """Tokens generated for training so far (EOS included, evaluation excluded)."""
    accuracy: float
    """Held-out avg@k, percent."""
    trained_tokens: int
    """Tokens of the rollouts the optimizer steps so far trained on (EOS included): the data the evaluated
    weights learned from. A synchronous run trains on all it sampled; an asynchronous one has also sampled
    the batch it generates ahead of the trainer, which `sampled_tokens` counts and this does not."""


@dataclass(frozen=True)
class WorkerSpec:
    """What the orchestrator hands a TRL worker process (as JSON)."""

    settings: Settings
    method: str
    """One of TRL_METHODS."""
    seed: int
    warm_dir: str
    run_dir: str

    @classmethod
    def read(cls, path: Path) -> WorkerSpec:
        raw = json.loads(path.read_text())
        return cls(Settings(**raw["settings"]), raw["method"], raw["seed"], raw["warm_dir"], raw["run_dir"])

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))


class HeldOut:
    """Scores any model's current weights exactly as our runs score theirs: our engine, our `evaluate`.

    The engine holds its own copy of the weights; each call copies the given model's state_dict in. It evaluates
    with the torch threads our runs evaluate with (`backend.torch_threads`) whatever the caller trains with, so a
    thread count cannot change a score (a matmul's sums, hence a sampled token, may depend on it).
    """

    def __init__(self, model: Any, tokenizer: Any, config: Any, prompts: list[Any], seed: int) -> None:
        from flashreinforce.controller.local import LocalBackend
        from flashreinforce.run.backends import build_episodes, build_verifier_pool
        from flashreinforce.run.engines import EngineShape, build_engine, eval_params, longest_rendered
        from flashreinforce.run.policy import Policy

        self.episodes = build_episodes(config, tokenizer)
        self.prompts = prompts
        self.seed = seed
        self.k = config.eval.k
        self.threads = config.backend.torch_threads
        self.params = eval_params(config)  # what our training run gives its held-out evaluation (run/hooks.py)
        shape = EngineShape(longest_rendered(self.episodes, prompts), config.rollout.max_new_tokens, version=0,
                            seed=seed)
        self.engine = build_engine(config, Policy(tokenizer, model), shape)
        self.pool = build_verifier_pool(config)
        self.backend = LocalBackend(self.engine, None, self.pool, tokenizer, overlap=False)

    def __call__(self, model: Any, version: int) -> float:
        import torch

        from flashreinforce.eval.evaluate import evaluate

        training_threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            self.engine.load_weights(model.state_dict(), version)
            report = asyncio.run(evaluate(self.backend, self.episodes, self.prompts, k=self.k, params=self.params,
                                          seed=self.seed))
        finally:
            torch.set_num_threads(training_threads)
        return report.overall.avg_at_k

    def close(self) -> None:
        self.pool.close()


def curve_from_metrics(path: Path) -> tuple[list[EvalPoint], dict[str, float]]:
    """Our run's eval curve and totals from its metrics.jsonl.

    Per step the loop logs `time/step_seconds` (from the end of the previous weight push to this one, so a
    held-out evaluation, which runs while generation is paused, is outside it) and the rollout throughput
    over that same interval; their product is the step's sampled tokens. `batch/policy_tokens` is what the
    step trained on.
    """
    points, seconds, tokens, trained, eval_seconds, step = [], 0.0, 0.0, 0, 0.0, 0
    for line in path.read_text().splitlines():
        row = json.loads(line)
        step = int(row["step"])
        if step > 0:
            seconds += row["time/step_seconds"]
            tokens += row["throughput/tokens_per_second"] * row["time/step_seconds"]
            trained += int(row["batch/policy_tokens"])
            eval_seconds += row.get("time/eval_seconds", 0.0)
        if "eval/avg@k" in row:
            points.append(EvalPoint(step, seconds, round(tokens), row["eval/avg@k"], trained))
    return points, {"steps": step, "seconds": seconds, "sampled_tokens": round(tokens), "eval_seconds": eval_seconds}
