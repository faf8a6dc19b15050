"""A pipeline of stages (`stages:` in a recipe): each stage runs on the weights the previous one left.

    run_dir/config.yaml          the whole recipe, stages included (what --resume reads)
    run_dir/initial/             the tiny model the first stage starts from (its tokenizer covers every stage's
                                 tasks), after the warm start when the first stage is RL with sft.steps
    run_dir/stages/NN-<name>/    each stage's own run directory: an RL stage's is a whole run's (config.yaml,
                                 metrics.jsonl, checkpoints/, summary.json, plots/); an sft stage's holds sft/,
                                 sft_eval.json and summary.json
    run_dir/metrics.jsonl        every finished stage's rows in order, each naming its stage; plots/ mark the
                                 boundaries
    run_dir/summary.json         at the end: each stage's before/after per task, and the totals

A stage whose summary.json exists is done; --resume skips it and continues the first one that is not, from its
newest checkpoint, else from where it starts (the previous stage's final checkpoint or sft/, or with `from: NAME`
that stage's: several stages can start from one, each training weights of its own, e.g. an RL expert per task
that a later `distill` stage takes as teachers, `teachers: {TASK: {stage: NAME}}`). A stage always
starts from what is on disk, never from objects in memory, so an uninterrupted run and a killed-and-resumed one
take the same path. Optimizer steps count across stages (an RL stage's steps follow the previous stages'), and
whatever is in flight when an RL stage ends is recorded dropped with reason `stage_end`.

Data and keys carry across stages too: an RL stage records in its summary.json where each of its tasks' own data
orders stands (`data_positions`), and a later stage training a task again on the same data goes on from there, so
every prompt of a task is trained once before its epoch wraps, whichever stages share the task (a task given other
data starts that data at its beginning). Rollout keys go on numbering each prompt's samples from the last RL
stage's, so a key, and the request seed drawn from it, is never used twice in a pipeline.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashreinforce.config import RunConfig, dump_config
from flashreinforce.metrics.console import Reporter
from flashreinforce.metrics.plots import plot_run
from flashreinforce.run.data import load_data
from flashreinforce.run.directory import create_run_dir, read_json, write_json_atomic
from flashreinforce.run.evaluation import EvalRequest, evaluate_checkpoint
from flashreinforce.run.policy import (
    load_policy,
    pretrained_policy,
    save_policy,
    seed_everything,
    tiny_policy,
    warm_start,
)
from flashreinforce.trainer.checkpoint import load_states, newest_intact_checkpoint


@dataclass(frozen=True)
class StageStart:
    """Where an RL stage begins, when it does not resume from a checkpoint of its own."""

    name: str
    first_version: int
    """Optimizer steps taken by the stages before it: its steps are first_version+1 ... first_version+steps."""
    model_dir: Path | None
    """The weights it starts from; None: the recipe's own start (model.path)."""
    trainer_state: dict[str, Any] | None
    """What the trainer carries over: the step count, bf16 masters or LoRA adapters, and AdamW's moments
    (optimizer: keep); never the previous stage's lr schedule."""
    data_starts: dict[str, int] = field(default_factory=dict)
    """Where each task's own data order begins ("" names a run without tasks); absent: at its beginning."""
    next_samples: dict[str, int] = field(default_factory=dict)
    """Each prompt's first unused sample number after the stages before it: keys stay unique in the pipeline."""
    warm_model_dir: Path | None = None
    """The model the pipeline's latest SFT left (None: model.path, when no SFT came first): where AHRL measures
    each prompt's initial pass@k (ERNIE eq. 5's pass_initial is the SFT model's)."""
    stage_models: dict[str, Path] = field(default_factory=dict)
    """Each earlier stage's final model, by name: the teachers a distill stage names by stage (`stage: NAME`)."""


def first_step(stage: StageStart | None) -> int:
    """The optimizer steps taken before a run or stage: a one-stage run starts at 0."""
    return stage.first_version if stage is not None else 0


RunRLStage = Callable[[RunConfig, Path, bool, Reporter, StageStart], dict[str, Any]]
"""run/training.py's run_stage: (stage config, stage directory, resume, reporter, start) -> its summary."""


def stage_directory(run_dir: Path, index: int, name: str) -> Path:
    return run_dir / "stages" / f"{index + 1:02d}-{name}"


def run_stages(config: RunConfig, run_dir: Path | None, resume: bool, reporter: Reporter,
               run_rl_stage: RunRLStage) -> dict[str, Any]:
    """Run (or resume) every stage in order; returns the pipeline's summary, also in run_dir/summary.json."""
    if not resume:
        run_dir = create_run_dir(config, run_dir)
    assert run_dir is not None
    model_dir, version, previous_rl = initial_model(config, run_dir, reporter), 0, None
    warm_model_dir, last_rl, positions = model_dir, None, DataPositions()
    summaries: list[dict[str, Any]] = []
    finished: dict[str, tuple[Path, Path | None]] = {}  # each stage's final model and, for an RL one, its checkpoint
    for index, stage in enumerate(config.stages):
        directory, stage_config = stage_directory(run_dir, index, stage.name), config.stage(index)
        reporter.note(f"stage {index + 1}/{len(config.stages)} {stage.name}: {stage.kind}, {stage.steps} steps"
                      + (f", from {stage.start}" if stage.start else ""))
        if stage.start is not None:  # its weights, and the trainer state that goes with them
            model_dir, previous_rl = finished[stage.start]
        summary = read_json(directory / "summary.json")
        if summary is None and stage.kind == "sft":
            summary = sft_stage(stage_config, directory, model_dir, stage.name, version, reporter)
        elif summary is None:
            carried = carried_state(previous_rl, keep=stage.optimizer == "keep", version=version)
            start = StageStart(stage.name, version, model_dir, carried, positions.starts(stage_config),
                               next_samples(last_rl), warm_model_dir,
                               {name: model for name, (model, _) in finished.items()})
            summary = run_rl_stage(stage_config, directory, (directory / "config.yaml").is_file(), reporter, start)
        summaries.append({"stage": stage.name, "kind": stage.kind, "steps": stage.steps, **summary})
        if stage.kind == "sft":
            model_dir = warm_model_dir = directory / "sft"
            previous_rl = None
        else:
            previous_rl = last_rl = newest_intact_checkpoint(directory / "checkpoints").checkpoint
            model_dir, version = previous_rl / "model", summary["optimizer_steps"]
            positions.record(stage_config, summary["data_positions"])
        finished[stage.name] = (model_dir, previous_rl)
        write_pipeline_metrics(run_dir, summaries)
    summary = pipeline_summary(run_dir, config, summaries)
    write_json_atomic(run_dir / "summary.json", summary)
    reporter.stages(summary["stages"])
    reporter.summary(summary, plot_run(run_dir))
    return summary


def initial_model(config: RunConfig, run_dir: Path, reporter: Reporter) -> Path | None:
    """The tiny model the first stage starts from, saved once to run_dir/initial; None with model.path (the
    first stage loads it). Its tokenizer holds every stage's tasks' characters and tags: later stages cannot add
    tokens to a model already trained."""
    if config.model.path is not None:
        return None
    directory = run_dir / "initial"
    if (directory / "config.json").is_file():
        return directory
    first = config.stage(0)
    kinds = [task.data.kind for index in range(len(config.stages)) for _, task in config.stage(index).task_list()]
    policy = tiny_policy(first, kinds=kinds)
    if config.stages[0].kind != "sft" and first.sft.steps:
        warm_start(first, load_data(first), policy, reporter)
    save_policy(policy, directory)
    return directory


class DataPositions:
    """Where each task's data order stood when an RL stage last trained it, and on which data: a stage training a
    task again on the same data starts there; on other data (its data section differs), at the beginning."""

    def __init__(self) -> None:
        self._stood: dict[str, tuple[str, int]] = {}  # task -> (its data's fingerprint, next position)

    def record(self, config: RunConfig, positions: dict[str, int]) -> None:
        data = dict(config.task_list())
        self._stood.update({name: (data_fingerprint(data[name].data), position) for name, position in positions.items()})

    def starts(self, config: RunConfig) -> dict[str, int]:
        starts = {}
        for name, task in config.task_list():
            fingerprint, position = self._stood.get(name, ("", 0))
            if position and fingerprint == data_fingerprint(task.data):
                starts[name] = position
        return starts


def data_fingerprint(data: Any) -> str:
    """A task's data section, as one value: equal sections give the same prompts in the same order."""
    return hashlib.sha256(json.dumps(data.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def next_samples(checkpoint: Path | None) -> dict[str, int]:
    """Each prompt's first unused sample number in an RL stage's final checkpoint ({} before any RL stage)."""
    if checkpoint is None:
        return {}
    _, controller_state, _ = load_states(checkpoint)
    return dict(controller_state["scheduler"]["book"]["next_sample"])


def carried_state(checkpoint: Path | None, *, keep: bool, version: int) -> dict[str, Any] | None:
    """The trainer state a stage starts with: from the final checkpoint of the RL stage whose weights it starts
    from, its masters or adapters and with `keep` its AdamW moments (not its schedule, nor its RNG: each stage seeds
    its own); after an sft stage or at the start, none. The step count is the pipeline's, `version` (a stage
    `from` an earlier one goes on counting, never back)."""
    if checkpoint is None:
        return {"version": version} if version else None
    trainer_state, _, _ = load_states(checkpoint)
    dropped = {"schedule", "torch_rng"} | (set() if keep else {"optimizer"})
    return {**{key: value for key, value in trainer_state.items() if key not in dropped}, "version": version}


def sft_stage(config: RunConfig, directory: Path, model_dir: Path | None, name: str, version: int,
              reporter: Reporter) -> dict[str, Any]:
    """SFT on the stage's tasks' demonstrations from `model_dir` (None: model.path, the pipeline's first stage),
    saved to directory/sft and scored on the stage's held-out prompts. Redone whole if killed before its
    summary.json."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.yaml").write_text(dump_config(config))
    seed_everything(config.seed)
    torch.set_num_threads(config.backend.torch_threads)
    policy = load_policy(model_dir) if model_dir is not None else pretrained_policy(config)
    warm_start(config, load_data(config), policy, reporter)
    save_policy(policy, directory / "sft")
    scores = evaluate_checkpoint(EvalRequest(directory / "sft", k=config.eval.k, num_prompts=config.eval.num_prompts,
                                             temperature=config.eval.temperature, top_p=config.eval.top_p,
                                             seed=config.seed, json_path=directory / "sft_eval.json"))
    summary = {"stage": name, "first_step": version, "optimizer_steps": version, "final_accuracy": scores["eval/avg@k"],
               **({"tasks": {task: {"final_accuracy": scores[f"eval/task/{task}/avg@k"]} for task in config.tasks}}
                  if config.tasks else {})}
    write_json_atomic(directory / "summary.json", summary)
    return summary


def write_pipeline_metrics(run_dir: Path, summaries: list[dict[str, Any]]) -> None:
    """run_dir/metrics.jsonl: every finished stage's rows, in order, rewritten whole after each stage, so a
    resumed pipeline's file reads like an uninterrupted one's."""
    lines = []
    for index, summary in enumerate(summaries):
        path = stage_directory(run_dir, index, summary["stage"]) / "metrics.jsonl"
        lines += [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    staging = run_dir / "metrics.jsonl.tmp"
    staging.write_text("".join(f"{line}\n" for line in lines))
    os.replace(staging, run_dir / "metrics.jsonl")


def pipeline_start_score(summaries: list[dict[str, Any]]) -> float:
    """Held-out before RL on the last stage's prompts, as a one-stage run has it: the earliest score over the same
    tasks (an SFT stage's after its warm start, or an RL stage's at its start). Stages in between may train fewer
    tasks: comparing the first RL stage's start with the end would compare different prompts."""
    last = summaries[-1]
    for summary in summaries:
        if set(summary.get("tasks", {})) == set(last.get("tasks", {})):
            return summary.get("initial_accuracy", summary["final_accuracy"])
    return last.get("initial_accuracy", last["final_accuracy"])


def pipeline_summary(run_dir: Path, config: RunConfig, summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole pipeline: its stages' summaries in order, and totals over them."""
    dropped: dict[str, int] = {}
    for summary in summaries:
        for reason, count in summary.get("dropped_trajectories", {}).items():
            dropped[reason] = dropped.get(reason, 0) + count
    last = summaries[-1]
    return {
        "run_dir": str(run_dir),
        "recipe": config.name,
        "stages": summaries,
        "initial_accuracy": pipeline_start_score(summaries),
        "final_accuracy": last["final_accuracy"],
        "eval_k": config.eval.k,
        "optimizer_steps": last["optimizer_steps"],
        "trained_trajectories": sum(s.get("trained_trajectories", 0) for s in summaries),
        "dropped_trajectories": dropped,
        "wall_seconds": sum(s.get("wall_seconds", 0.0) for s in summaries),
    }

