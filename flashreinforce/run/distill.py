"""A distillation run's teachers seen from the run (algo.loss=opd): which model each one is, and how each scores on
the held-out prompts of the tasks it teaches.

Every teacher reference becomes a model directory here, once, in the run's own process, before the trainer is
built (run/teachers.py loads them where the trainer runs): a pipeline stage's final model (`stage: NAME`), a run of
ours (its final model, as `flashreinforce eval` reads it), a converted model's name, a Hugging Face id (fetched once
into its cache) or a directory. Each teacher's held-out score is measured once, on an engine of its own, and kept in
the run directory (teacher_eval.json), so the summary can put it beside the student's, task by task.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flashreinforce.config import RunConfig
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.metrics.console import Reporter
from flashreinforce.models.causal_lm import check_model_dir
from flashreinforce.models.hub import is_hub_id
from flashreinforce.models.tokenizer import load_tokenizer
from flashreinforce.run.data import Data
from flashreinforce.run.directory import read_json, write_json_atomic
from flashreinforce.run.evaluation import on_fresh_backend, resolve_model_dir
from flashreinforce.run.hooks import HeldOut
from flashreinforce.run.policy import resolve_model_path, tiny_tokenizer
from flashreinforce.run.teachers import check_vocabulary
from flashreinforce.types import Prompt


def resolve_teachers(config: RunConfig, stage_models: Mapping[str, Path]) -> RunConfig:
    """The config with every teacher's `path` a model directory (`stage_models`: each finished stage's final model,
    by name; {} outside a pipeline, where a `stage:` teacher is an error naming the fix)."""
    if not config.teachers:
        return config
    resolved = {}
    for task, teacher in config.teachers.items():
        field = f"teachers.{task}"
        if teacher.stage is not None and teacher.stage not in stage_models:
            raise ValueError(f"{field}.stage={teacher.stage}: a stage's model is a teacher only inside a pipeline, "
                             f"from a stage of `stages:` that has finished; in a run of its own set {field}.path to a "
                             "model or a run directory")
        path = stage_models[teacher.stage] if teacher.stage is not None else teacher_model_dir(teacher.path, field)
        resolved[task] = teacher.model_copy(update={"path": str(path), "stage": None})
    return config.model_copy(update={"teachers": resolved})


def check_teachers(config: RunConfig, run: RunConfig) -> None:
    """Before any work (each stage's `config` at a pipeline's start, `run` the whole recipe; `train --dry-run`):
    every teacher named by path is a model there is, its directory intact, that reads the student's token ids (a
    Hugging Face id not on this machine is fetched and checked when its stage starts; a `stage:` teacher is the
    pipeline's own model)."""
    named = {task: teacher.path for task, teacher in (config.teachers or {}).items()
             if teacher.path is not None and not is_hub_id(teacher.path)}
    student = student_tokenizer(run) if named else None
    for task, path in named.items():
        directory = check_model_dir(teacher_model_dir(path, f"teachers.{task}"), field=f"teachers.{task}.path")
        if student is not None:
            check_vocabulary(student, directory, field=f"teachers.{task}.path={path}")


def student_tokenizer(run: RunConfig) -> Any:
    """The student's tokenizer, as the run will build it: model.path's (None for a Hugging Face id not on this
    machine yet), or the tiny model's, which holds every stage's tasks' characters."""
    if run.model.path is not None:
        return None if is_hub_id(run.model.path) else load_tokenizer(resolve_model_path(run.model.path))
    stages = [run.stage(index) for index in range(len(run.stages))] if run.stages else [run]
    return tiny_tokenizer(stages[0], [task.data.kind for stage in stages for _, task in stage.task_list()])


def teacher_model_dir(path: str, field: str) -> Path:
    """A teacher's `path` as a model directory: a converted model's or a Hub id's (models get / the Hub cache), a
    run's or a checkpoint's final model, or the directory itself."""
    try:
        return resolve_model_dir(resolve_model_path(path))[0]
    except ValueError as error:
        raise ValueError(f"{field}.path={path}: {error}") from None


def teacher_directories(config: RunConfig) -> dict[str, list[str]]:
    """Each distinct teacher directory and the tasks it scores (in the run's task order)."""
    teachers = config.teachers or {}
    tasks: dict[str, list[str]] = {}
    for task, _ in config.task_list():
        tasks.setdefault(teachers[task if task in teachers else "all"].path, []).append(task)
    return tasks


async def teacher_evaluation(config: RunConfig, run_dir: Path, prompts: Sequence[Prompt],
                             reporter: Reporter) -> dict[str, dict[str, Any]]:
    """Each task's teacher's held-out avg@k (and greedy accuracy, if measured) on the student's held-out `prompts` of
    that task, sampled as the student's are: {task: {"model": directory, "accuracy": ..., ...}}. Measured once, kept
    in run_dir/teacher_eval.json."""
    path = run_dir / "teacher_eval.json"
    kept = read_json(path)
    if kept is not None:
        return kept
    scores: dict[str, dict[str, Any]] = {}
    for directory, tasks in teacher_directories(config).items():
        own = [prompt for prompt in prompts if prompt.task in tasks]
        data = Data([], own, 0, {name: ([], [p for p in own if p.task == name]) for name in config.tasks or {}})

        async def job(backend, episodes: TextEpisodes, own: list[Prompt] = own) -> dict[str, float]:
            return (await HeldOut(config, backend, episodes, own).report()).metrics()
        with reporter.status(f"held-out evaluation of the teacher {directory}"):
            metrics = await on_fresh_backend(config, Path(directory), data, config.seed, job)
        for task in tasks:
            prefix = f"eval/task/{task}" if task else "eval"
            scores[task] = {"model": directory, "accuracy": metrics[f"{prefix}/avg@k"],
                            **({"greedy_accuracy": metrics[f"{prefix}/greedy_accuracy"]}
                               if f"{prefix}/greedy_accuracy" in metrics else {})}
    reporter.note("teachers: " + ", ".join(f"{task or 'the run'} {score['accuracy']:.1f}%"
                                           for task, score in scores.items()) + " held-out")
    write_json_atomic(path, scores)
    return scores
