"""The run's scheduler over the seeded data order, with DAPO's dynamic-sampling filter when asked for."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashreinforce.algorithms.dapo import dynamic_sampling_keep
from flashreinforce.buffer import Scheduler, build_scheduler, scheduler_options
from flashreinforce.config import RunConfig
from flashreinforce.data.order import MixedOrder, PromptOrder
from flashreinforce.run.data import Data
from flashreinforce.types import Trajectory


def build_run_scheduler(config: RunConfig, data: Data, kind: str | None = None, first_step: int = 0) -> Scheduler:
    """scheduler.kind (or `kind`) with its options from the config section, over the run's data order, its first
    batch following optimizer step `first_step` (a pipeline's later stage)."""
    schedule = config.scheduler
    kind = kind or schedule.kind
    order = run_order(config, data)
    return build_scheduler(
        kind,
        prompt_at=order.__getitem__,
        batch_groups=schedule.batch_groups,
        group_size=schedule.group_size,
        group_filter=keeps_mixed_rewards if config.algo.dynamic_sampling else None,
        first_step=first_step,
        **{name: getattr(schedule, name) for name in scheduler_options(kind)},
    )


def run_order(config: RunConfig, data: Data) -> PromptOrder | MixedOrder:
    """The training prompt at every position: the data's seeded order, or with tasks their mixture by weight (each
    task's prompts in its own seeded order, the interleaving seeded by the run's seed)."""
    if not data.by_task:
        return PromptOrder(list(data.train), seed=config.data.shuffle_seed)
    tasks = dict(config.task_list())
    orders = {name: PromptOrder(train, seed=tasks[name].data.shuffle_seed) for name, (train, _) in data.by_task.items()}
    return MixedOrder(orders, {name: task.weight for name, task in tasks.items()}, seed=config.seed)


def keeps_mixed_rewards(group: Sequence[Trajectory]) -> bool:
    """DAPO dynamic sampling on one complete group: keep it iff its rewards are not all equal."""
    rewards = torch.tensor([t.reward for t in group])
    return bool(dynamic_sampling_keep(rewards, torch.zeros(len(group), dtype=torch.long)).all())
