"""The run's scheduler over the seeded data order, with DAPO's dynamic-sampling filter when asked for."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashreinforce.algorithms.dapo import dynamic_sampling_keep
from flashreinforce.buffer import Scheduler, build_scheduler, scheduler_options
from flashreinforce.config import RunConfig
from flashreinforce.data.order import PromptOrder
from flashreinforce.types import Prompt, Trajectory


def build_run_scheduler(config: RunConfig, train: Sequence[Prompt], kind: str | None = None) -> Scheduler:
    """scheduler.kind (or `kind`) with its options from the config section, over PromptOrder(train)."""
    schedule = config.scheduler
    kind = kind or schedule.kind
    order = PromptOrder(list(train), seed=config.data.shuffle_seed)
    return build_scheduler(
        kind,
        prompt_at=order.__getitem__,
        batch_groups=schedule.batch_groups,
        group_size=schedule.group_size,
        group_filter=keeps_mixed_rewards if config.algo.dynamic_sampling else None,
        **{name: getattr(schedule, name) for name in scheduler_options(kind)},
    )


def keeps_mixed_rewards(group: Sequence[Trajectory]) -> bool:
    """DAPO dynamic sampling on one complete group: keep it iff its rewards are not all equal."""
    rewards = torch.tensor([t.reward for t in group])
    return bool(dynamic_sampling_keep(rewards, torch.zeros(len(group), dtype=torch.long)).all())
