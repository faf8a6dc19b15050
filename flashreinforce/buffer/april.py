"""`april`: APRIL, active partial rollouts (ALGORITHMS.md §2). Fast, and biased on purpose.

1. Over-provision: keep ceil(over_provision * B) incomplete groups open (fewer fresh ones while a full
   batch already waits to be trained, so finished work cannot pile up without bound).
2. Stop at target: take_batch returns the first B groups to COMPLETE (all G rollouts finished and kept by
   the filter), in completion order; short and easy prompts therefore train first.
3. Abort: at every weight update the controller aborts all in-flight rollouts (`abort_on_update`) and
   hands the partials to on_aborted. The whole group stays, finished siblings unchanged, never regenerated.
4. Resume first: aborted groups are served before any fresh prompt, oldest group first (FIFO), each
   rollout carrying its partial so the engine continues its prefix, log-probs and versions exactly.
Optional `mask_offpolicy` trains only each row's newest-policy tokens (slime
`--mask-offpolicy-in-partial-rollout`).
"""

from __future__ import annotations

import dataclasses
import math
from itertools import compress

from flashreinforce.buffer.book import (Group, GroupBook, GroupFilter, PromptAt, RolloutTask, restore_scheduler_state,
                                        check_step, group_from_state, group_state, scheduler_state, train_batch)
from flashreinforce.buffer.ledger import Ledger
from flashreinforce.types import Generation, RolloutKey, Trajectory


class AprilScheduler:
    abort_on_update = True

    def __init__(self, prompt_at: PromptAt, batch_groups: int, group_size: int,
                 group_filter: GroupFilter | None = None, first_step: int = 0, *, over_provision: float = 2.0,
                 mask_offpolicy: bool = False) -> None:
        if not over_provision >= 1.0:
            raise ValueError(f"april: over_provision must be >= 1.0 (groups in flight per batch group; APRIL "
                             f"recommends 2.0), got {over_provision!r}")
        self.batch_groups = batch_groups
        self.group_filter = group_filter
        self.over_provision = over_provision
        self.mask_offpolicy = mask_offpolicy
        self.ledger = Ledger()
        self.book = GroupBook(prompt_at, group_size, self.ledger, first_position=first_step * batch_groups)
        self._open_target = math.ceil(over_provision * batch_groups)
        self._ready: list[Group] = []  # complete, kept, in completion order
        self._last_step: int | None = None
        self._lag: dict[str, float] = {}

    def admit(self, free_slots: int, version: int) -> list[RolloutTask]:
        def may_open() -> bool:
            return len(self.book.groups) < self._open_target and len(self._ready) < self.batch_groups

        return self.book.admit(free_slots, version, may_open)

    def on_finished(self, trajectory: Trajectory) -> None:
        group = self.book.finish(trajectory)
        if group is not None and self.book.keep(group, self.group_filter):
            self._ready.append(group)

    def on_aborted(self, task: RolloutTask, partial: Generation) -> None:
        self.book.park(task, partial)

    def take_batch(self, version: int) -> list[Trajectory] | None:
        check_step(version, self._last_step)
        if len(self._ready) < self.batch_groups:
            return None
        taken, self._ready = self._ready[:self.batch_groups], self._ready[self.batch_groups:]
        if self.mask_offpolicy:
            for group in taken:
                group.finished = {k: mask_offpolicy_prefix(t) for k, t in group.finished.items()}
        batch, self._lag = train_batch(taken, self.ledger, version)
        self._last_step = version
        self.ledger.check()
        return batch

    def on_version(self, version: int) -> list[RolloutKey]:
        return []  # the controller aborts everything at an update anyway (abort_on_update)

    def stats(self) -> dict[str, float]:
        return {**self.book.stats(), "buffer/ready_groups": len(self._ready), **self._lag}

    def state_dict(self) -> dict:
        return scheduler_state("april", self._options(), self.book, self._last_step, self._lag,
                               ready=[group_state(g) for g in self._ready])

    def load_state_dict(self, state: dict) -> None:
        self._last_step, self._lag = restore_scheduler_state(state, "april", self._options(), self.book)
        self._ready = [group_from_state(g, self.book.prompt_at) for g in state["ready"]]

    def _options(self) -> dict:
        return {"batch_groups": self.batch_groups, "group_size": self.book.group_size,
                "over_provision": self.over_provision, "mask_offpolicy": self.mask_offpolicy}


def mask_offpolicy_prefix(trajectory: Trajectory) -> Trajectory:
    """Keep loss only on sampled tokens of the row's newest policy version.

    Under APRIL a version changes only at an update, and every update aborts and later resumes the row, so
    "newest version" is "generated after the last resume": older segments (off-policy) get loss_mask 0.
    Example: versions (-1, 3, 3, 4, 4), loss_mask (0, 1, 1, 1, 1) -> loss_mask (0, 0, 0, 1, 1).
    """
    sampled = list(compress(trajectory.policy_versions, trajectory.loss_mask))
    if not sampled:
        return trajectory
    newest = max(sampled)
    mask = tuple(int(m == 1 and v == newest) for v, m in zip(trajectory.policy_versions, trajectory.loss_mask))
    return dataclasses.replace(trajectory, loss_mask=mask)
