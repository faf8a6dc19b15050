"""The run's scheduler over the seeded data order, with DAPO's dynamic-sampling filter when asked for."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from flashreinforce.algorithms.dapo import dynamic_sampling_keep
from flashreinforce.buffer import Scheduler, build_scheduler, scheduler_options
from flashreinforce.config import RunConfig
from flashreinforce.data.order import ContinuedOrder, MixedOrder, PromptOrder
from flashreinforce.run.data import Data
from flashreinforce.types import Trajectory


def build_run_scheduler(config: RunConfig, data: Data, kind: str | None = None, first_step: int = 0,
                        starts: Mapping[str, int] | None = None) -> Scheduler:
    """scheduler.kind (or `kind`) with its options from the config section, over the run's data order, its first
    batch following optimizer step `first_step` (a pipeline's later stage; the scheduler numbers its positions
    from first_step * B, where the stage's order begins). `starts`: where each task's own order begins (a later
    stage goes on through a task's prompts where the earlier ones stopped); none: at the beginning."""
    schedule = config.scheduler
    kind = kind or schedule.kind
    order, base = run_order(config, data, starts), first_step * schedule.batch_groups
    return build_scheduler(
        kind,
        prompt_at=lambda position: order[position - base],
        batch_groups=schedule.batch_groups,
        group_size=schedule.group_size,
        group_filter=keeps_mixed_rewards if config.algo.dynamic_sampling else None,
        first_step=first_step,
        **{name: getattr(schedule, name) for name in scheduler_options(kind)},
    )


def run_order(config: RunConfig, data: Data,
              starts: Mapping[str, int] | None = None) -> PromptOrder | ContinuedOrder | MixedOrder:
    """The training prompt at every position: the data's seeded order, or with tasks their mixture by weight (each
    task's prompts in its own seeded order, the interleaving seeded by the run's seed). `starts`: each task's first
    position in its own order (the one task of a run without tasks is named "")."""
    starts = starts or {}

    def continued(order: PromptOrder, name: str) -> PromptOrder | ContinuedOrder:
        return ContinuedOrder(order, starts[name]) if starts.get(name) else order

    if not data.by_task:
        return continued(PromptOrder(list(data.train), seed=config.data.shuffle_seed), "")
    tasks = dict(config.task_list())
    orders = {name: continued(PromptOrder(train, seed=tasks[name].data.shuffle_seed), name)
              for name, (train, _) in data.by_task.items()}
    return MixedOrder(orders, {name: task.weight for name, task in tasks.items()}, seed=config.seed)


def task_positions(config: RunConfig, data: Data, starts: Mapping[str, int] | None, opened: int) -> dict[str, int]:
    """Where each task's own order stands after the first `opened` positions of the run's order (from `starts`):
    the position a later stage training the task again begins at."""
    starts = starts or {}
    if not data.by_task:
        return {"": starts.get("", 0) + opened}
    order = run_order(config, data, starts)
    assert isinstance(order, MixedOrder)
    return {name: starts.get(name, 0) + count for name, count in order.positions_before(opened).items()}


def keeps_mixed_rewards(group: Sequence[Trajectory]) -> bool:
    """DAPO dynamic sampling on one complete group: keep it iff its rewards are not all equal."""
    rewards = torch.tensor([t.reward for t in group])
    return bool(dynamic_sampling_keep(rewards, torch.zeros(len(group), dtype=torch.long)).all())
