"""The run's prompts: a built-in task (run/tasks.py), or train/eval files in the common RL format."""

from __future__ import annotations

from dataclasses import dataclass

from flashreinforce.config import RunConfig
from flashreinforce.data.loaders import load_prompts
from flashreinforce.types import Prompt


@dataclass(frozen=True)
class Data:
    train: list[Prompt]
    eval: list[Prompt]
    skipped_rows: int
    """Bad rows skipped (data.on_bad_row=skip), both files together."""


def load_data(config: RunConfig) -> Data:
    from flashreinforce.run.tasks import (
        TASKS,  # tasks renders traces with the policy's tokenizer: above data
    )

    if config.data.kind in TASKS:
        train, held_out = TASKS[config.data.kind].splits(config)
        return Data(train=train, eval=held_out, skipped_rows=0)
    train = load_prompts(config.data.train, on_bad_row=config.data.on_bad_row)
    held_out = load_prompts(config.data.eval, on_bad_row=config.data.on_bad_row)
    return Data(train=train.prompts, eval=held_out.prompts, skipped_rows=len(train.skipped) + len(held_out.skipped))
