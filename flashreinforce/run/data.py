"""The run's prompts: a built-in task (run/tasks.py), reasoning-gym tasks and GSM8K (docs/data.md), train/eval files
in the common RL format, or an environment's own (data.kind=env: a verifiers taskset's tasks, seeded OpenEnv
episodes)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from pathlib import Path

from flashreinforce.config import RECIPES_DIR, ReasoningGymConfig, RunConfig
from flashreinforce.data.gsm8k import gsm8k_prompts
from flashreinforce.data.loaders import load_prompts
from flashreinforce.data.reasoning_gym import make_reasoning_gym_splits
from flashreinforce.envs.openenv_env import seeded_prompts
from flashreinforce.envs.verifiers_env import taskset_prompts
from flashreinforce.types import Prompt


@dataclass(frozen=True)
class Data:
    train: list[Prompt]
    eval: list[Prompt]
    skipped_rows: int
    """Bad rows skipped (data.on_bad_row=skip), both files together."""
    by_task: dict[str, tuple[list[Prompt], list[Prompt]]] = field(default_factory=dict)
    """A mixture run's (train, eval) per task, in the config's order; {} in a one-task run."""


def load_data(config: RunConfig) -> Data:
    """The run's prompts; with tasks, each task's own, tagged with it (Prompt.task, an id "<task>/<id>", its
    modality)."""
    if config.tasks is None:
        return load_task_data(config)
    by_task, skipped = {}, 0
    for name, task in config.task_list():
        data = load_task_data(config.for_task(name))
        tag = functools.partial(tagged, task=name, modality=task.modality)
        by_task[name] = ([tag(p) for p in data.train], [tag(p) for p in data.eval])
        skipped += data.skipped_rows
    return Data(train=[p for train, _ in by_task.values() for p in train],
                eval=[p for _, held_out in by_task.values() for p in held_out], skipped_rows=skipped, by_task=by_task)


def tagged(prompt: Prompt, *, task: str, modality: str | None) -> Prompt:
    return replace(prompt, id=f"{task}/{prompt.id}", task=task, modality=modality or prompt.modality)


def load_task_data(config: RunConfig) -> Data:
    from flashreinforce.run.tasks import (
        TASKS,  # tasks renders traces with the policy's tokenizer: above data
    )

    if config.data.kind in TASKS:
        train, held_out = TASKS[config.data.kind].splits(config)
        return Data(train=train, eval=held_out, skipped_rows=0)
    if config.data.kind in ("reasoning_gym", "gsm8k"):
        train, held_out = generated_splits(config)
        return Data(train=train, eval=held_out, skipped_rows=0)
    if config.data.kind == "env":
        train, held_out = environment_splits(config)
        return Data(train=train, eval=held_out, skipped_rows=0)
    for split, path in (("train", config.data.train), ("eval", config.data.eval)):
        if not Path(path).exists():
            recipe = RECIPES_DIR / f"{config.name}.yaml"
            origin = f"; the {config.name} recipe's header ({recipe}) says what it holds and where it comes from" \
                if recipe.is_file() else ""
            raise ValueError(f"data.{split}={path} does not exist (relative paths start at {Path.cwd()}){origin}")
    train = load_prompts(config.data.train, on_bad_row=config.data.on_bad_row, max_pixels=config.data.max_pixels)
    held_out = load_prompts(config.data.eval, on_bad_row=config.data.on_bad_row, max_pixels=config.data.max_pixels)
    return Data(train=train.prompts, eval=held_out.prompts, skipped_rows=len(train.skipped) + len(held_out.skipped))


def environment_splits(config: RunConfig) -> tuple[list[Prompt], list[Prompt]]:
    """data.kind=env: a verifiers environment's tasks (env.kind=verifiers), or seeded episodes of an OpenEnv
    environment, data.env.instruction their prompt (env.kind=openenv; config checked the kinds)."""
    settings = config.data.env
    if config.env.kind == "verifiers":
        return taskset_prompts(config.env.options, num_train=settings.num_train, num_eval=settings.num_eval,
                               eval_overrides=settings.eval)
    return seeded_prompts(settings.instruction, num_train=settings.num_train, num_eval=settings.num_eval,
                          chat=settings.chat)


def generated_splits(config: RunConfig) -> tuple[list[Prompt], list[Prompt]]:
    """data.kind=reasoning_gym: data.reasoning_gym's tasks, held out from the same generators (plus the real GSM8K
    problems with eval_gsm8k). data.kind=gsm8k: trains on gsm_symbolic, holds out the real GSM8K problems only."""
    kind, settings = config.data.kind, config.data.reasoning_gym  # config checked model.path is set
    tasks, num_eval = settings.tasks, settings.num_eval
    if kind == "gsm8k":
        if list(tasks) not in (list(ReasoningGymConfig.model_fields["tasks"].default), ["gsm_symbolic"]):
            raise ValueError(f"data.kind=gsm8k trains on gsm_symbolic, not data.reasoning_gym.tasks={tasks}: drop "
                             "tasks, or use data.kind=reasoning_gym with data.reasoning_gym.eval_gsm8k=true")
        tasks, num_eval = ["gsm_symbolic"], 0
    splits = make_reasoning_gym_splits(tasks, config=settings.config, num_train=settings.num_train,
                                       num_eval=num_eval, seed=settings.seed, instruction=settings.instruction)
    held_out = splits.eval
    if kind == "gsm8k" or settings.eval_gsm8k:
        held_out = [*held_out, *gsm8k_prompts(settings.instruction)]
    return splits.train, held_out
