"""`flashreinforce train`: a whole RL run put together from a RunConfig.

    data -> policy (model.path, the latest intact checkpoint, or the tiny model after SFT) -> engine,
    scheduler, verifier pool, metrics sink, trainer, backend -> held-out eval -> RL loop with checkpoints
    -> held-out eval -> summary.json, plots

Each part comes from its own builder (engines.py, learner.py, scheduling.py, backends.py, hooks.py); this
module only orders them and closes what it opened. `resume` continues a run from its newest intact
checkpoint, with the same data order and its in-flight partial rollouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from flashreinforce.buffer import Scheduler
from flashreinforce.config import RunConfig
from flashreinforce.controller.episodes import EpisodeBackend
from flashreinforce.controller.loop import LoopSettings, RLLoop
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.metrics.console import Reporter
from flashreinforce.metrics.plots import plot_run
from flashreinforce.metrics.sink import MetricsSink
from flashreinforce.run.ahrl import build_hints
from flashreinforce.run.backends import (
    build_env_pool,
    build_episode_backend,
    build_episodes,
    check_buildable,
    check_verifiers,
    open_backend,
)
from flashreinforce.run.data import Data, load_data
from flashreinforce.run.devices import thread_oversubscription, usable_cores
from flashreinforce.run.directory import create_run_dir, read_json, write_json_atomic
from flashreinforce.run.distill import check_teachers, resolve_teachers, teacher_evaluation
from flashreinforce.run.endpoint import build_agent_parts, start_agent_parts
from flashreinforce.run.engines import check_tiny_context, engine_shape, model_context, rollout_params
from flashreinforce.run.hooks import CheckpointWriter, HeldOut, StepLog
from flashreinforce.run.policy import Policy, build_policy, load_policy, seed_everything
from flashreinforce.run.scheduling import build_run_scheduler, task_positions
from flashreinforce.run.stages import StageStart, first_step, run_stages
from flashreinforce.trainer.checkpoint import newest_intact_checkpoint
from flashreinforce.verifiers.pool import VerifierPool

# Our own progress display is enough; transformers would add a bar for every checkpoint it writes.
transformers.utils.logging.disable_progress_bar()


def run_training(config: RunConfig, *, run_dir: Path | None = None, resume: bool = False,
                 reporter: Reporter | None = None) -> dict[str, Any]:
    """Run (or resume) the job, each of its stages in turn if it has `stages`; returns the summary also written
    to run_dir/summary.json."""
    reporter = reporter or Reporter(enabled=config.log.progress)
    if resume:
        assert run_dir is not None, "resume needs the run directory"
    if config.stages:
        for index, stage in enumerate(config.stages):  # a part the last stage lacks stops the run before the first
            if stage.kind != "sft":
                try:
                    check_buildable(config.stage(index))
                    check_teachers(config.stage(index), config)
                except ValueError as error:
                    raise ValueError(f"stages[{index}] ({stage.name}): {error}") from None
        return run_stages(config, run_dir, resume, reporter, run_rl_stage=run_stage)
    return run_stage(config, run_dir, resume, reporter)


def run_stage(config: RunConfig, run_dir: Path | None, resume: bool, reporter: Reporter,
              stage: StageStart | None = None) -> dict[str, Any]:
    """One RL run (a whole recipe, or one stage of a pipeline) in run_dir."""
    check_buildable(config)
    resolved = resolve_teachers(config, stage.stage_models if stage is not None else {})  # before any file is written
    if not resume:
        run_dir = create_run_dir(config, run_dir)  # as written: a teacher by its stage, Hub id or run
    config = resolved
    seed_everything(config.seed)
    torch.set_num_threads(config.backend.torch_threads)
    oversubscribed = thread_oversubscription(config, usable_cores())
    if oversubscribed:
        reporter.warn(oversubscribed)
    summary = asyncio.run(_train(config, run_dir, resume, reporter, stage))
    reporter.summary(summary, plot_run(run_dir))
    return summary


@dataclass(frozen=True)
class Start:
    """Where a run starts: the policy, and the saved states when it resumes from a checkpoint."""

    policy: Policy
    trainer_state: dict[str, Any] | None
    controller_state: dict[str, Any] | None
    wall_seconds: float
    """Wall time the run had already spent before this start."""
    checkpoint: Path | None

    @property
    def version(self) -> int:
        return self.trainer_state["version"] if self.trainer_state else 0


@dataclass(frozen=True)
class RunParts:
    """Everything a run built, for the loop and the summary."""

    config: RunConfig
    run_dir: Path
    data: Data
    episodes: TextEpisodes
    scheduler: Scheduler
    pool: VerifierPool
    sink: MetricsSink
    trainer: Any
    backend: EpisodeBackend
    agents: Any = None
    """The endpoint's parts and server (run/endpoint.py), when the run serves it."""


def starting_point(config: RunConfig, run_dir: Path, data: Data, resume: bool, reporter: Reporter,
                   stage: StageStart | None) -> Start:
    """The newest intact checkpoint's policy and states (damaged newer ones are set aside, with a warning),
    else where the stage starts (the previous stage's weights and carried trainer state), else the run's initial
    policy."""
    resumable = newest_intact_checkpoint(run_dir / "checkpoints", set_aside=True) if resume else None
    if resumable is None and stage is not None and stage.model_dir is not None:
        return Start(load_policy(stage.model_dir), stage.trainer_state, None, 0.0, None)
    if resumable is None:
        return Start(build_policy(config, data, run_dir, reporter), None, None, 0.0, None)
    for aside, reason in resumable.skipped:
        reporter.warn(f"skipped a damaged checkpoint ({reason}), kept as {aside}; "
                      f"resuming from {resumable.checkpoint}")
    policy = load_policy(resumable.checkpoint / "model")
    torch.set_rng_state(resumable.trainer_state["torch_rng"])
    return Start(policy, resumable.trainer_state, resumable.controller_state, resumable.meta["wall_seconds"],
                 resumable.checkpoint)


def open_parts(config: RunConfig, run_dir: Path, data: Data, start: Start, resume: bool,
               stack: contextlib.AsyncExitStack, stage: StageStart | None = None) -> RunParts:
    """Build the run's parts; `stack` closes each one that was opened, whatever fails later. The backend builds
    its own engine, trainer and verifier pool: in this process, or in Ray actors (run/backends.py)."""
    episodes = build_episodes(config, start.policy.tokenizer, start.policy.model)
    shape = engine_shape(config, episodes, data, model_context(start.policy.model), version=start.version,
                         seed=config.seed)
    opened = open_backend(config, start.policy, shape, stack)
    scheduler = build_run_scheduler(config, data, first_step=first_step(stage),
                                    starts=stage.data_starts if stage is not None else None)
    if stage is not None and start.controller_state is None:  # a stage's start (a resume restores its own)
        scheduler.book.continue_samples(stage.next_samples)
    sink = MetricsSink(run_dir, tensorboard=config.log.tensorboard, wandb=config.log.wandb,
                       config=config.model_dump(mode="json"), resume_step=start.version if resume else None,
                       tags={"stage": stage.name} if stage is not None else None)
    stack.callback(sink.close)
    env_pool = build_env_pool(config, opened.env_workers)
    if env_pool is not None:
        stack.push_async_callback(env_pool.aclose)
    agents = build_agent_parts(config, start.policy.tokenizer, shape.context, stack)
    backend = build_episode_backend(config, opened.backend, episodes, env_pool, shape.context,
                                    agents[0] if agents is not None else None)
    stack.push_async_callback(backend.close)
    if start.trainer_state is not None:
        opened.trainer.load_state_dict(start.trainer_state)
    return RunParts(config, run_dir, data, episodes, scheduler, opened.pool, sink, opened.trainer, backend, agents)


async def _train(config: RunConfig, run_dir: Path, resume: bool, reporter: Reporter,
                 stage: StageStart | None) -> dict[str, Any]:
    started = time.perf_counter()
    last_step = first_step(stage) + config.trainer.steps
    data = load_data(config)
    check_verifiers(config, data)
    check_tiny_context(config, data)
    start = starting_point(config, run_dir, data, resume, reporter, stage)
    async with contextlib.AsyncExitStack() as stack:
        parts = open_parts(config, run_dir, data, start, resume, stack, stage)
        if parts.backend.pool is not None:
            await parts.backend.pool.start()  # an environment that cannot be built fails here, saying why
        await start_agent_parts(parts.agents, run_dir)  # the endpoint and agent workers, when the run has them
        held_out = HeldOut(config, parts.backend, parts.episodes, data.eval)
        initial = await initial_evaluation(parts, held_out, reporter)
        teachers = await teacher_evaluation(config, run_dir, held_out.prompts, reporter) if config.teachers else {}
        writer = CheckpointWriter(config, run_dir, parts.backend, parts.trainer,
                                  clock=lambda: start.wall_seconds + time.perf_counter() - started)
        progress = reporter.training(total=last_step, completed=parts.trainer.version)
        log = StepLog(config, parts.sink, parts.episodes, progress, initial["metrics"])
        hints = await build_hints(config, run_dir, parts.backend, parts.episodes, data.train, reporter, stage)
        loop = RLLoop(parts.backend, parts.scheduler, parts.episodes, loop_settings(config, last_step), on_step=log,
                      on_checkpoint=writer, evaluate=held_out.metrics, hints=hints, version=parts.trainer.version)
        if start.controller_state is not None:
            await loop.restore(start.controller_state)
            reporter.note(f"resumed from {start.checkpoint} at step {parts.trainer.version} "
                          f"with {len(start.controller_state['inflight'])} in-flight partial rollouts")
        with progress:
            await loop.run()
        if stage is not None:  # the next stage has its own data and scheduler: what is still in flight ends here
            for key in parts.scheduler.ledger.outstanding():
                parts.scheduler.ledger.drop(key, "stage_end")
        parts.scheduler.ledger.check()
        final = await final_evaluation(parts, held_out, log.last_eval, last_step, reporter)
        summary = with_teachers(summarize(parts, held_out, initial["metrics"], final, writer.clock()), teachers)
        if stage is not None:
            opened = parts.scheduler.book.cursor - first_step(stage) * config.scheduler.batch_groups
            summary.update(stage=stage.name, first_step=stage.first_version,
                           data_positions=task_positions(config, data, stage.data_starts, opened))
        write_json_atomic(run_dir / "summary.json", summary)
        return summary


def loop_settings(config: RunConfig, last_step: int) -> LoopSettings:
    """The loop's settings; it stops at version `last_step` (a stage's steps after those of the stages before it)."""
    return LoopSettings(total_steps=last_step, sampling=rollout_params(config), seed=config.seed,
                        task_sampling={name: rollout_params(config.for_task(name)) for name in config.tasks or {}},
                        checkpoint_every=config.trainer.checkpoint_every, eval_every=config.eval.every,
                        overlap=not config.deterministic, in_flight_updates=config.rollout.in_flight_updates)


async def initial_evaluation(parts: RunParts, held_out: HeldOut, reporter: Reporter) -> dict[str, Any]:
    """The held-out score before RL: measured once, kept in initial_eval.json for a resumed run."""
    initial = await evaluation_once(parts, held_out, parts.run_dir / "initial_eval.json",
                                    reporter.status("held-out evaluation before RL"), redo_after_steps=False)
    reporter.note(f"before RL: {initial['describe']}")
    return initial


async def final_evaluation(parts: RunParts, held_out: HeldOut, last_eval: dict[str, float], last_step: int,
                           reporter: Reporter) -> dict[str, float]:
    """The held-out score after RL, unless the last step already evaluated it (eval.every divides it); measured
    once, kept in final_eval.json: a run killed after it (before its summary) does not score or log it twice."""
    config = parts.config
    if config.trainer.steps and config.eval.every and last_step % config.eval.every == 0:
        return last_eval
    final = await evaluation_once(parts, held_out, parts.run_dir / "final_eval.json",
                                  reporter.status("held-out evaluation after RL"), redo_after_steps=True)
    reporter.note(f"after RL: {final['describe']}")
    return final["metrics"]


async def evaluation_once(parts: RunParts, held_out: HeldOut, path: Path, status: contextlib.AbstractContextManager,
                          *, redo_after_steps: bool) -> dict[str, Any]:
    """A held-out evaluation done once whatever kills and resumes come: its result is kept in `path` first, then
    logged at the version it was taken at, and a resume logs a kept result only if its row is not there yet. One
    kept at another version than the trainer's is taken again when `redo_after_steps` (a final evaluation after
    more steps), else kept (the evaluation before RL of a run resumed later on)."""
    version = parts.trainer.version
    kept = read_json(path)
    if kept is None or (redo_after_steps and kept.get("version") != version):
        with status:
            report = await held_out.report()
        kept = {"version": version, "metrics": report.metrics(), "describe": report.describe()}
        write_json_atomic(path, kept)
    taken_at = kept.get("version")  # None: kept by an older run, which logged it itself
    if taken_at is not None and not parts.sink.has_evaluation(taken_at):
        parts.sink.log(taken_at, kept["metrics"])
    return kept


def summarize(parts: RunParts, held_out: HeldOut, initial: dict[str, float], final: dict[str, float],
              wall_seconds: float) -> dict:
    ledger = parts.scheduler.ledger.summary()
    return {
        "run_dir": str(parts.run_dir),
        "recipe": parts.config.name,
        "initial_accuracy": initial["eval/avg@k"],
        "final_accuracy": final["eval/avg@k"],
        "eval_k": parts.config.eval.k,
        "eval_prompts": len(held_out.prompts),  # in a mixture, eval.num_prompts of each task's
        "wall_seconds": wall_seconds,
        "optimizer_steps": parts.trainer.version,
        "trained_trajectories": ledger["trained"],
        "dropped_trajectories": {k.split("/", 1)[1]: v for k, v in ledger.items() if k.startswith("dropped/")},
        "unfinished_at_end": ledger["outstanding"],
        "skipped_data_rows": parts.data.skipped_rows,
        "verifier": parts.pool.stats(),
        **{f"{when}_{name}": metrics[f"eval/{name}"] for when, metrics in (("initial", initial), ("final", final))
           for name in ("greedy_accuracy", "distinct_answers", "turns", "tool_calls") if f"eval/{name}" in metrics},
        **({"tasks": task_summary(parts.config, held_out, initial, final)} if parts.config.tasks else {}),
    }


def with_teachers(summary: dict[str, Any], teachers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The summary with the teachers' held-out scores beside the student's: each task's teacher_accuracy (a run
    without tasks: the run's), and "teachers" (each task's teacher and its scores); as it is without teachers."""
    if not teachers:
        return summary
    for task, scores in summary.get("tasks", {}).items():
        scores["teacher_accuracy"] = teachers[task]["accuracy"]
    if "" in teachers:
        summary["teacher_accuracy"] = teachers[""]["accuracy"]
    return {**summary, "teachers": teachers}


def task_summary(config: RunConfig, held_out: HeldOut, initial: dict[str, float],
                 final: dict[str, float]) -> dict[str, dict]:
    """Each task's held-out score before and after RL (its own prompts and verifier), and how many prompts."""
    return {name: {"eval_prompts": sum(p.task == name for p in held_out.prompts),
                   **{f"{when}_{metric}": scores[f"eval/task/{name}/{key}"]
                      for when, scores in (("initial", initial), ("final", final))
                      for metric, key in (("accuracy", "avg@k"), ("greedy_accuracy", "greedy_accuracy"))
                      if f"eval/task/{name}/{key}" in scores}}
            for name in config.tasks}
