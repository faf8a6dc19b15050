"""`flashreinforce train --dry-run`: the config a run would use, and the checks it makes before it trains.

The checks are the run's own (run_training and run_stage call the same functions), made for every stage up
front: the parts the run builds (check_buildable: loss and its options, engine, backend, environments, LoRA;
check_teachers: the teachers named by path),
its data (built-in tasks generated, files read and every row parsed), each task's verifier (a user function
imported and its signature checked; rows that reach a registered verifier carry ground truths it can read), and
that the tiny model's context holds the run. No model is loaded and nothing is trained.
"""

from __future__ import annotations

from typing import Any

import yaml

from flashreinforce.config import STAGE_SECTIONS, RunConfig
from flashreinforce.run.backends import check_buildable, check_verifiers
from flashreinforce.run.data import load_data
from flashreinforce.run.distill import check_teachers
from flashreinforce.run.engines import check_tiny_context
from flashreinforce.verifiers.rewards import load_reward_fn, resolve_reward_ref


def check_run(config: RunConfig) -> str:
    """Raises ValueError naming the stage and what is wrong, as the run would; returns what was checked."""
    stages = [("", config, "rl")] if not config.stages else [
        (f"stages[{index}] ({stage.name}): ", config.stage(index), stage.kind)
        for index, stage in enumerate(config.stages)]
    for where, stage_config, kind in stages:
        try:
            if kind != "sft":  # an sft stage builds no engine, backend or environment of its own
                check_buildable(stage_config)
                check_teachers(stage_config, config)
            data = load_data(stage_config)
            check_verifiers(stage_config, data)
            check_user_verifiers(stage_config)
            check_tiny_context(stage_config, data)
        except ValueError as error:
            raise ValueError(f"{where}{error}") from None
    what = f"each of the {len(stages)} stages" if config.stages else "the run"
    return f"checked {what} (parts, data, verifiers, context); no model loaded, nothing trained"


def check_user_verifiers(config: RunConfig) -> None:
    """Each task's user reward function ("file.py:fn" or "module:fn") imported and its signature checked, as the
    verifier pool's first worker does when a run starts."""
    for name, task in config.task_list():
        if isinstance(task.verifier, str) and ":" in task.verifier and not (task.env.multi_turn
                                                                           and task.env.reward == "env"):
            try:
                load_reward_fn(resolve_reward_ref(task.verifier))
            except ValueError as error:
                raise ValueError(f"{f'tasks.{name}.verifier' if name else 'verifier.reward_fn'}: {error}") from None


def resolved_tree(config: RunConfig) -> dict[str, Any]:
    """The config as the run uses it: without the sections `tasks:` leaves unused (data, env and the one-task
    verifier.reward_fn) or that are off (tasks, stages: None), and each stage with the sections it overrides as
    they resolve (merged over the run's), not as written. Read back as a recipe it is the same run."""
    tree = config.model_dump(mode="json", exclude={"stages"})
    if config.tasks is None:
        del tree["tasks"]
    else:
        del tree["data"], tree["env"], tree["verifier"]["reward_fn"]
    if config.stages:
        tree["stages"] = [stage_tree(config, index) for index in range(len(config.stages))]
    return tree


def stage_tree(config: RunConfig, index: int) -> dict[str, Any]:
    stage, resolved = config.stages[index], config.stage(index).model_dump(mode="json")
    tree = stage.model_dump(mode="json", include={"name", "kind", "start", "steps", "optimizer"}, by_alias=True,
                            exclude_none=True)
    tree.update({section: resolved[section] for section in STAGE_SECTIONS if getattr(stage, section) is not None})
    return tree


def resolved_yaml(config: RunConfig) -> str:
    return yaml.safe_dump(resolved_tree(config), sort_keys=False)
