"""Shared fixtures: the smallest complete run configuration."""

from __future__ import annotations

import pytest

TINY_RUN = [
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=1",
    "model.tiny.num_heads=2",
    "data.arithmetic.num_train=400",
    "data.arithmetic.num_eval=16",
    "sft.steps=20",
    "sft.batch_size=16",
    "rollout.max_batch_size=16",
    "rollout.max_new_tokens=40",
    "scheduler.batch_groups=8",
    "trainer.steps=3",
    "trainer.microbatch_size=4",
    "trainer.checkpoint_every=1",
    "eval.num_prompts=8",
    "eval.k=2",
    "log.progress=false",
    "log.tensorboard=true",
    "verifier.min_workers=1",
    "verifier.max_workers=1",
]
"""Dotted overrides of the default recipe for a run of a few seconds on one core."""


@pytest.fixture
def tiny_run() -> list[str]:
    return list(TINY_RUN)
