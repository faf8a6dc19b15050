"""`stream`: FlashREINFORCE's asynchronous mode. The learner takes the next B completed groups.

Typically G=1 (one rollout per prompt); with G>1 every rule below applies to whole groups. Staleness is
bounded per token: a token sampled at version v and trained at step t has lag t - v <= S (max_staleness),
so a group whose oldest token is v has the deadline step v + S.
- Admission (AReaL-style): a group admitted at version v is due by step v+S, and steps n..v+S (n = the
  next step to train) hold (v+S-n+1)*B groups, so a new group opens only while outstanding groups
  (incomplete + complete untrained) < (v+S-n+1)*B. With the engine current (v = n) that is (S+1)*B; while
  the learner trains (v = n-1) it is S*B, which keeps every deadline reachable.
- Batch order: ready groups oldest token first (earliest deadline), ties in completion order; with equal
  versions this is plain completion order.
- stale_policy="gate" (default): nothing is dropped. take_batch returns None unless the work left after
  this step can still meet every deadline at B groups per step (earliest deadline first), so the learner
  waits for old work, which then goes in first. Unbiased: long rollouts are waited for, never dropped.
- stale_policy="drop": at on_version(v), any group whose oldest token (admission version for unfinished
  rollouts) is older than v - S is dropped ("stale") and its prompt re-queued as a fresh group with new
  sample numbers, served before fresh prompts; its in-flight keys are returned for the controller to
  cancel. take_batch applies the same test to complete groups. Drops favour short rollouts.
Both rely on admit() being given the version of the weights the engine generates with.
"""

from __future__ import annotations

import math
from typing import Literal

from flashreinforce.buffer.book import (Group, GroupBook, GroupFilter, PromptAt, RolloutTask, restore_scheduler_state,
                                        check_step, group_from_state, group_state, scheduler_state, train_batch)
from flashreinforce.buffer.ledger import Ledger
from flashreinforce.types import Generation, RolloutKey, Trajectory

StalePolicy = Literal["drop", "gate"]


class StreamScheduler:
    abort_on_update = False  # in-flight work continues under the new weights

    def __init__(self, prompt_at: PromptAt, batch_groups: int, group_size: int,
                 group_filter: GroupFilter | None = None, first_step: int = 0, *, max_staleness: int = 1,
                 stale_policy: StalePolicy = "gate") -> None:
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"stream: max_staleness (S) must be an int >= 0 (0 = on-policy), got {max_staleness!r}")
        if stale_policy not in ("drop", "gate"):
            raise ValueError(f"stream: stale_policy must be 'drop' or 'gate', got {stale_policy!r}")
        self.batch_groups = batch_groups
        self.group_filter = group_filter
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.ledger = Ledger()
        self.book = GroupBook(prompt_at, group_size, self.ledger, first_position=first_step * batch_groups)
        self._ready: list[Group] = []  # complete, kept, in completion order
        self._last_step: int | None = None
        self._lag: dict[str, float] = {}

    def admit(self, free_slots: int, version: int) -> list[RolloutTask]:
        next_step = version if self._last_step is None else self._last_step + 1
        capacity = (version + self.max_staleness - next_step + 1) * self.batch_groups
        return self.book.admit(free_slots, version, lambda: self.outstanding_groups < capacity)

    @property
    def outstanding_groups(self) -> int:
        return len(self.book.groups) + len(self._ready)

    def on_finished(self, trajectory: Trajectory) -> None:
        group = self.book.finish(trajectory)
        if group is not None and self.book.keep(group, self.group_filter):
            self._ready.append(group)

    def on_aborted(self, task: RolloutTask, partial: Generation) -> None:
        self.book.park(task, partial)

    def take_batch(self, version: int) -> list[Trajectory] | None:
        check_step(version, self._last_step)
        S = self.max_staleness
        if self.stale_policy == "drop":
            cancel = self._drop_stale(self._ready, version - S)
            assert not cancel, f"complete groups had rollouts in flight: {cancel}"
        if len(self._ready) < self.batch_groups:
            return None
        order = sorted(range(len(self._ready)), key=lambda i: (self._oldest_or_inf(self._ready[i]), i))
        chosen = set(order[:self.batch_groups])
        taken = [g for i, g in enumerate(self._ready) if i in chosen]
        rest = [g for i, g in enumerate(self._ready) if i not in chosen]
        if self.stale_policy == "gate" and not self._on_time(rest + list(self.book.groups.values()), version + 1):
            return None
        self._ready = rest
        batch, self._lag = train_batch(taken, self.ledger, version)
        self._last_step = version
        assert self._lag["buffer/lag_max"] <= S, (
            f"trained a token {self._lag['buffer/lag_max']} versions old at step {version} > max_staleness {S}: "
            "was admit() given a version newer than the engine's weights?")
        self.ledger.check()
        return batch

    def on_version(self, version: int) -> list[RolloutKey]:
        if self.stale_policy == "gate":
            return []
        return self._drop_stale(self._ready + list(self.book.groups.values()), version - self.max_staleness)

    def _drop_stale(self, groups: list[Group], min_version: int) -> list[RolloutKey]:
        """Drop ("stale") and re-queue every group with a token older than min_version; return keys to cancel."""
        cancel: list[RolloutKey] = []
        for group in list(groups):  # a copy: `groups` may be self._ready, which shrinks below
            oldest = self.book.oldest_version(group)
            if oldest is None or oldest >= min_version:
                continue
            if group in self._ready:
                self._ready.remove(group)
            cancel += self.book.retire(group, "stale")
            self.book.open(group.position, group.prompt)
        return cancel

    def _on_time(self, groups: list[Group], first_step: int) -> bool:
        """Can `groups` all train by their deadlines at B groups per step from `first_step` on?

        Earliest deadline first is optimal, so it suffices that for the i-th earliest deadline d (0-based),
        i+1 <= (d - first_step + 1) * B. Groups with no sampled token yet have no deadline.
        """
        deadlines = sorted(oldest + self.max_staleness for g in groups
                           if (oldest := self.book.oldest_version(g)) is not None)
        return all(i + 1 <= (d - first_step + 1) * self.batch_groups for i, d in enumerate(deadlines))

    def _oldest_or_inf(self, group: Group) -> float:
        oldest = self.book.oldest_version(group)
        return math.inf if oldest is None else oldest

    def stats(self) -> dict[str, float]:
        return {**self.book.stats(), "buffer/ready_groups": len(self._ready),
                "buffer/outstanding_groups": self.outstanding_groups, **self._lag}

    def state_dict(self) -> dict:
        return scheduler_state("stream", self._options(), self.book, self._last_step, self._lag,
                               ready=[group_state(g) for g in self._ready])

    def load_state_dict(self, state: dict) -> None:
        self._last_step, self._lag = restore_scheduler_state(state, "stream", self._options(), self.book)
        self._ready = [group_from_state(g, self.book.prompt_at) for g in state["ready"]]

    def _options(self) -> dict:
        return {"batch_groups": self.batch_groups, "group_size": self.book.group_size,
                "max_staleness": self.max_staleness, "stale_policy": self.stale_policy}
