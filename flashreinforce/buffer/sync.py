"""`sync`: synchronous RL, the baseline. Generate one whole batch under the current weights, train, repeat.

Iteration t admits B groups from the data cursor (positions [t*B, (t+1)*B) when nothing is filtered), at
most as many rollouts as there are free slots at a time, and nothing more until the batch is trained AND
the engine holds the new weights (admit's `version` is past the last trained step). So every token is
trained with lag 0 and the slowest rollout sets the pace. A filtered group, or one dropped because a rollout
of it sampled nothing (env_error), is replaced by the next prompt.
"""

from __future__ import annotations

from flashreinforce.buffer.book import (Group, GroupBook, GroupFilter, PromptAt, RolloutTask, check_step,
                                        group_from_state, group_state, restore_scheduler_state, scheduler_state,
                                        train_batch)
from flashreinforce.buffer.ledger import Ledger
from flashreinforce.types import Generation, RolloutKey, Trajectory


class SyncScheduler:
    abort_on_update = False  # nothing is in flight at an update

    def __init__(self, prompt_at: PromptAt, batch_groups: int, group_size: int,
                 group_filter: GroupFilter | None = None, first_step: int = 0) -> None:
        self.batch_groups = batch_groups
        self.group_filter = group_filter
        self.ledger = Ledger()
        self.book = GroupBook(prompt_at, group_size, self.ledger, first_position=first_step * batch_groups)
        self._kept: list[Group] = []  # complete groups that passed the filter, in completion order
        self._last_step: int | None = None
        self._lag: dict[str, float] = {}

    def admit(self, free_slots: int, version: int) -> list[RolloutTask]:
        def may_open() -> bool:
            weights_updated = self._last_step is None or version > self._last_step
            return weights_updated and len(self.book.groups) + len(self._kept) < self.batch_groups

        return self.book.admit(free_slots, version, may_open)

    def on_finished(self, trajectory: Trajectory) -> None:
        group = self.book.finish(trajectory)
        if group is not None and self.book.keep(group, self.group_filter):
            self._kept.append(group)

    def on_aborted(self, task: RolloutTask, partial: Generation) -> None:
        self.book.park(task, partial)

    def take_batch(self, version: int) -> list[Trajectory] | None:
        check_step(version, self._last_step)
        if len(self._kept) < self.batch_groups:
            return None
        batch, self._lag = train_batch(self._kept, self.ledger, version)
        self._kept, self._last_step = [], version
        self.ledger.check()
        return batch

    def on_version(self, version: int) -> list[RolloutKey]:
        return []

    def stats(self) -> dict[str, float]:
        return {**self.book.stats(), "buffer/ready_groups": len(self._kept), **self._lag}

    def state_dict(self) -> dict:
        return scheduler_state("sync", self._options(), self.book, self._last_step, self._lag,
                               kept=[group_state(g) for g in self._kept])

    def load_state_dict(self, state: dict) -> None:
        self._last_step, self._lag = restore_scheduler_state(state, "sync", self._options(), self.book)
        self._kept = [group_from_state(g, self.book.prompt_at) for g in state["kept"]]

    def _options(self) -> dict:
        return {"batch_groups": self.batch_groups, "group_size": self.book.group_size}
