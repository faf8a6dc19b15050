"""The Scheduler protocol the controller drives, and `build_scheduler` over a literal dict of kinds.

A scheduler is a pure state machine: it decides which rollouts run next and which finished ones form the
next learner batch. No asyncio, threads or I/O; every call returns at once.

Checkpoint protocol (nothing lost, nothing duplicated: exactly once survives a crash). state_dict() may be taken
between any two calls, typically while the engine is paused for a weight push; it holds the ledger, the
data cursor, finished and parked rollouts, and the rollouts in flight, which STAY in flight:
  save:    report every finished generation first (on_finished; pending verification included), then
           save scheduler.state_dict() together with each in-flight task and its partial generation;
  restore: build the scheduler with the same kind and options, load_state_dict(state), re-submit every
           saved partial to the engine, keep each task, and report it later with on_finished or
           on_aborted as usual. Nothing else: admit() then continues exactly where the saved run was.
Pausing for the save and resuming in place does not reorder anything, so a resumed run replays the
uninterrupted one. The state is builtins plus Trajectory / Generation records: picklable; the ledger part
is also JSON-friendly.
"""

from __future__ import annotations

import inspect
from typing import Protocol

from flashreinforce.buffer.april import AprilScheduler
from flashreinforce.buffer.book import GroupBook, GroupFilter, PromptAt, RolloutTask
from flashreinforce.buffer.ledger import Ledger
from flashreinforce.buffer.stream import StreamScheduler
from flashreinforce.buffer.sync import SyncScheduler
from flashreinforce.buffer.urb import URBScheduler
from flashreinforce.types import Generation, RolloutKey, Trajectory


class Scheduler(Protocol):
    ledger: Ledger
    book: GroupBook
    """The bookkeeping every kind shares: the data cursor, open groups, rollouts in flight."""
    abort_on_update: bool
    """True: the controller aborts all in-flight work at each weight update and returns it via on_aborted.
    False: in-flight work continues across the update under the new weights."""

    def admit(self, free_slots: int, version: int) -> list[RolloutTask]:
        """At most free_slots tasks to start (parked resumes first). `version`: the engine's weight version."""

    def on_finished(self, trajectory: Trajectory) -> None:
        """A task finished generation and verification. One that sampled nothing (its environment failed before
        the first turn) can never be trained: its group is dropped whole, "env_error", once it completes."""

    def on_aborted(self, task: RolloutTask, partial: Generation) -> None:
        """A task was aborted: preempted, an april update, or cancelled by on_version. Resumed later unless
        cancelled."""

    def take_batch(self, version: int) -> list[Trajectory] | None:
        """The batch the learner trains at `version`, sorted by (group, sample), or None if it must wait.

        [] (urb with a group filter only): D_t was consumed and all of it filtered out. Run no optimizer
        step and push nothing; the version stays; call again."""

    def on_version(self, version: int) -> list[RolloutKey]:
        """After a weight update: in-flight keys to cancel (already dropped); pass each to on_aborted."""

    def stats(self) -> dict[str, float]:
        """Flat metrics under buffer/: in_flight, waiting, ready_groups, scheduled, trained, dropped_<reason>,
        lag_mean and lag_max of the last batch, and kind-specific ones; with a group filter the groups it kept and
        dropped (dynamic_sampling/..., per task of a mixture)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


SCHEDULERS: dict[str, type] = {
    "sync": SyncScheduler,
    "april": AprilScheduler,
    "urb": URBScheduler,
    "stream": StreamScheduler,
}


def build_scheduler(kind: str, *, prompt_at: PromptAt, batch_groups: int, group_size: int,
                    group_filter: GroupFilter | None = None, first_step: int = 0, **options) -> Scheduler:
    """A scheduler of `kind` over the data order prompt_at(0), prompt_at(1), ...

    batch_groups: B, prompt groups per learner batch; group_size: G, rollouts per prompt. first_step: the
    optimizer step its first batch follows (a pipeline's later stage): it opens data at position first_step * B,
    where a run of first_step steps would be, and urb's D_t counts from t = first_step. Options per kind:
    april: over_provision=2.0, mask_offpolicy=False; urb: buffer_size (N, required);
    stream: max_staleness=1, stale_policy="gate" | "drop". group_filter(trajectories of one group) -> keep?
    """
    for name, value in (("batch_groups", batch_groups), ("group_size", group_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"scheduler.{name} must be an int >= 1, got {value!r}")
    allowed = scheduler_options(kind)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"scheduler.kind={kind!r} has no option(s) {unknown}; "
                         f"its options are {list(allowed) or 'none'}")
    missing = [p.name for p in _options(kind) if p.default is p.empty and p.name not in options]
    if missing:
        raise ValueError(f"scheduler.kind={kind!r} needs option(s) {missing}; e.g. buffer_size=2 for urb")
    return SCHEDULERS[kind](prompt_at, batch_groups, group_size, group_filter, first_step, **options)


def scheduler_options(kind: str) -> tuple[str, ...]:
    """The options `kind` accepts, e.g. ("buffer_size",) for urb: pick them out of a config section."""
    if kind not in SCHEDULERS:
        raise ValueError(f"scheduler.kind={kind!r} is unknown; choose one of {sorted(SCHEDULERS)}")
    return tuple(p.name for p in _options(kind))


def _options(kind: str) -> list[inspect.Parameter]:
    """Keyword-only parameters of the kind's constructor: its options, read from one place."""
    return [p for p in inspect.signature(SCHEDULERS[kind]).parameters.values() if p.kind is p.KEYWORD_ONLY]
