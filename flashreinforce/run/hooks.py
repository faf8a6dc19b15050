"""What happens around each optimizer step of a run: metrics and samples, checkpoints, held-out evaluation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from flashreinforce.config import RunConfig
from flashreinforce.controller.backend import Backend
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.eval.evaluate import EvalReport, evaluate
from flashreinforce.metrics.console import TrainingProgress
from flashreinforce.metrics.groups import group_metrics
from flashreinforce.metrics.sink import MetricsSink
from flashreinforce.run.engines import eval_params
from flashreinforce.trainer.checkpoint import save_checkpoint
from flashreinforce.types import Prompt, Trajectory


class HeldOut:
    """The run's held-out evaluation: eval.k samples of each of the first eval.num_prompts prompts."""

    def __init__(self, config: RunConfig, backend: Backend, episodes: TextEpisodes, prompts: Sequence[Prompt]) -> None:
        """In a mixture, eval.num_prompts of each task's held-out prompts, each sampled as its task says."""
        self.config, self.backend, self.episodes = config, backend, episodes
        by_task: dict[str, list[Prompt]] = {}
        for prompt in prompts:
            by_task.setdefault(prompt.task, []).append(prompt)
        self.prompts = [p for members in by_task.values() for p in members[: config.eval.num_prompts]]
        self.task_params = {name: eval_params(config.for_task(name)) for name in config.tasks or {}}

    async def report(self) -> EvalReport:
        return await evaluate(self.backend, self.episodes, self.prompts, k=self.config.eval.k,
                              params=eval_params(self.config), seed=self.config.seed, greedy=self.config.eval.greedy,
                              task_params=self.task_params)

    async def metrics(self, version: int) -> dict[str, float]:
        """The loop's EvalHook: flat eval/* metrics (the weights of `version` are the engine's)."""
        return (await self.report()).metrics()


class StepLog:
    """The loop's StepHook: metrics.jsonl (+ TensorBoard/W&B), samples.jsonl and the progress line."""

    def __init__(self, config: RunConfig, sink: MetricsSink, episodes: TextEpisodes, progress: TrainingProgress,
                 last_eval: dict[str, float]) -> None:
        self.samples_per_step = config.log.samples_per_step
        self.sink, self.episodes, self.progress = sink, episodes, progress
        self.last_eval = dict(last_eval)
        """The latest eval/* metrics: the initial evaluation's until one runs during training."""

    def __call__(self, version: int, metrics: dict[str, float], batch: Sequence[Trajectory]) -> None:
        if "eval/avg@k" in metrics:
            self.last_eval.update({k: v for k, v in metrics.items() if k.startswith("eval/")})
        metrics = {**metrics, **group_metrics(batch, version)}
        self.sink.log(version, metrics)
        if self.samples_per_step:
            self.sink.samples(version, sample_rows(batch, self.episodes, self.samples_per_step))
        self.progress.update(version, metrics, self.last_eval.get("eval/avg@k"))


class CheckpointWriter:
    """The loop's CheckpointHook: an atomic checkpoint of model, trainer state, RNG and the loop's state."""

    def __init__(self, config: RunConfig, run_dir: Path, backend: Backend, trainer: Any,
                 clock: Callable[[], float]) -> None:
        self.directory, self.keep = run_dir / "checkpoints", config.trainer.keep_checkpoints
        self.backend, self.trainer = backend, trainer
        self.clock = clock
        """The run's wall seconds so far, counted across resumes (meta.json keeps them)."""

    def __call__(self, version: int, state: dict[str, Any]) -> None:
        save_checkpoint(self.directory, version, write_model=self.backend.save_model,
                        trainer_state={**self.trainer.state_dict(), "torch_rng": torch.get_rng_state()},
                        controller_state=state, meta={"wall_seconds": self.clock()}, keep=self.keep)


def sample_rows(batch: Sequence[Trajectory], episodes: TextEpisodes, count: int) -> list[dict[str, Any]]:
    """The first `count` trajectories of a batch, decoded, with reward, verdict and policy versions."""
    rows = []
    for trajectory in list(batch)[:count]:
        versions = [v for v, m in zip(trajectory.policy_versions, trajectory.loss_mask) if m]
        rows.append({
            "prompt_id": trajectory.key.prompt_id,
            "sample": trajectory.key.sample,
            "prompt": episodes.decode(trajectory.tokens[: trajectory.prompt_length]),
            "completion": episodes.decode(trajectory.tokens[trajectory.prompt_length:]),
            "ground_truth": trajectory.prompt.ground_truth,
            "reward": trajectory.reward,
            "reason": trajectory.verdict.reason,
            "finish_reason": trajectory.finish_reason,
            "versions": [min(versions), max(versions)],
        })
    return rows
