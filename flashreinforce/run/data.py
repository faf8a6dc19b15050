"""The run's prompts: the built-in arithmetic task, or train/eval files in the common RL format."""

from __future__ import annotations

from dataclasses import dataclass

from flashreinforce.config import RunConfig
from flashreinforce.data.arithmetic import make_arithmetic_splits
from flashreinforce.data.loaders import load_prompts
from flashreinforce.types import Prompt


@dataclass(frozen=True)
class Data:
    train: list[Prompt]
    eval: list[Prompt]
    skipped_rows: int
    """Bad rows skipped (data.on_bad_row=skip), both files together."""


def load_data(config: RunConfig) -> Data:
    if config.data.kind == "arithmetic":
        settings = config.data.arithmetic
        splits = make_arithmetic_splits(
            settings.num_train, settings.num_eval, seed=settings.seed, digit_weights=settings.digit_weights
        )
        return Data(train=splits.train, eval=splits.eval, skipped_rows=0)
    train = load_prompts(config.data.train, on_bad_row=config.data.on_bad_row)
    held_out = load_prompts(config.data.eval, on_bad_row=config.data.on_bad_row)
    return Data(train=train.prompts, eval=held_out.prompts, skipped_rows=len(train.skipped) + len(held_out.skipped))
