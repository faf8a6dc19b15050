"""`urb`: ERNIE 5.0's unbiased replay buffer (ALGORITHMS.md §1.1). Iteration t trains exactly D_t.

D_t = data positions [t*B, (t+1)*B). Prompts enter P_infer in data order, only from data groups
[t, t+N-1], so P_infer never holds more than B*N queries (N = buffer_size). take_batch returns D_t once
every rollout of D_t is terminal, whatever order they finished in; finished rollouts of later groups wait,
and their in-flight work continues across weight updates (per-token versions record it). A token of D_t is
therefore at most N-1 versions old, and N=1 is synchronous RL.

The window is anchored at the data group the engine's weights will train next, which is the lower of t
and version + s, s = data groups consumed without a step (all filtered, below). While the learner trains
D_t the engine still holds the version before it, and a group admitted then must not be N groups ahead
(its tokens would be N stale).

Filtering (DAPO) stays inside D_t: the batch is D_t's kept groups, never topped up from D_{t+1} (a group
dropped because a rollout of it sampled nothing, env_error, counts as filtered here). If every
group of D_t is filtered, take_batch returns [] and consumes D_t: the controller skips the optimizer step
(the version does not change) and calls take_batch again with the same version. Such a D_t takes no
version, so the version that trains D_g is at most g - s, and anchoring at version + s keeps both the lag
bound (<= N-1) and the look-ahead (N groups) however many groups were filtered.
"""

from __future__ import annotations

from flashreinforce.buffer.book import (Group, GroupBook, GroupFilter, PromptAt, RolloutTask, restore_scheduler_state,
                                        check_step, group_from_state, group_state, scheduler_state, train_batch)
from flashreinforce.buffer.ledger import Ledger
from flashreinforce.types import Generation, RolloutKey, Trajectory


class URBScheduler:
    abort_on_update = False  # future-group work keeps decoding across the update

    def __init__(self, prompt_at: PromptAt, batch_groups: int, group_size: int,
                 group_filter: GroupFilter | None = None, first_step: int = 0, *, buffer_size: int) -> None:
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"urb: buffer_size (N) must be an int >= 1 (P_infer holds B*N queries; N=1 is sync), "
                             f"got {buffer_size!r}")
        self.batch_groups = batch_groups
        self.group_filter = group_filter
        self.buffer_size = buffer_size
        self.ledger = Ledger()
        self.book = GroupBook(prompt_at, group_size, self.ledger, first_position=first_step * batch_groups)
        self.iteration = first_step
        """t: the data group the next batch trains on."""
        self._done: dict[int, Group | None] = {}  # complete groups by position; None = filtered out
        self.skipped = 0
        """s: data groups consumed without an optimizer step (every group of them filtered out)."""
        self._last_step: int | None = None
        self._lag: dict[str, float] = {}

    def admit(self, free_slots: int, version: int) -> list[RolloutTask]:
        B = self.batch_groups
        anchor = min(self.iteration, version + self.skipped)  # the data group the engine's weights train next
        end = (anchor + self.buffer_size) * B  # first position of the first group too far
        tasks = self.book.admit(free_slots, version, lambda: self.book.cursor < end)
        assert self.queries_in_infer <= B * self.buffer_size, (
            f"P_infer holds {self.queries_in_infer} queries > B*N = {B * self.buffer_size}")
        return tasks

    @property
    def queries_in_infer(self) -> int:
        """Queries admitted and not yet trained (or dropped): those of groups [t, t+N-1] opened so far."""
        return self.book.cursor - self.iteration * self.batch_groups

    def on_finished(self, trajectory: Trajectory) -> None:
        group = self.book.finish(trajectory)
        if group is not None:
            self._done[group.position] = group if self.book.keep(group, self.group_filter) else None

    def on_aborted(self, task: RolloutTask, partial: Generation) -> None:
        self.book.park(task, partial)

    def take_batch(self, version: int) -> list[Trajectory] | None:
        check_step(version, self._last_step)
        start = self.iteration * self.batch_groups
        positions = range(start, start + self.batch_groups)
        if any(p not in self._done for p in positions):
            return None
        kept = [g for g in (self._done.pop(p) for p in positions) if g is not None]
        self.iteration += 1
        if not kept:
            self.skipped += 1
            return []
        batch, self._lag = train_batch(kept, self.ledger, version)
        self._last_step = version
        self.ledger.check()
        return batch

    def on_version(self, version: int) -> list[RolloutKey]:
        return []

    def stats(self) -> dict[str, float]:
        return {**self.book.stats(), "buffer/ready_groups": sum(g is not None for g in self._done.values()),
                "buffer/iteration": self.iteration, "buffer/skipped_groups": self.skipped,
                "buffer/queries_in_infer": self.queries_in_infer, **self._lag}

    def state_dict(self) -> dict:
        return scheduler_state("urb", self._options(), self.book, self._last_step, self._lag, iteration=self.iteration,
                               skipped=self.skipped,
                               done=[group_state(g) for g in self._done.values() if g is not None],
                               filtered=[p for p, g in self._done.items() if g is None])

    def load_state_dict(self, state: dict) -> None:
        self._last_step, self._lag = restore_scheduler_state(state, "urb", self._options(), self.book)
        self.iteration = state["iteration"]
        self.skipped = state.get("skipped", 0)  # absent from checkpoints written before it was counted
        self._done = {p: None for p in state["filtered"]}
        for entry in state["done"]:
            group = group_from_state(entry, self.book.prompt_at)
            self._done[group.position] = group

    def _options(self) -> dict:
        return {"batch_groups": self.batch_groups, "group_size": self.book.group_size,
                "buffer_size": self.buffer_size}
