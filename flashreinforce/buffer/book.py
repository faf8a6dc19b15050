"""Bookkeeping every scheduler shares: the data cursor, open groups, and where each rollout is.

A group is one prompt (its data position) with `group_size` rollouts. Each rollout of an open group is
waiting (never admitted, or parked: aborted with a partial to resume), in flight, or finished. The book
answers "what runs next" in one fixed order, (position, sample), which puts parked and half-admitted
groups ahead of fresh prompts. It does NOT decide when a new group may open, when a batch is ready or what
is too stale: that is each scheduler's policy. Pure state, no I/O, no clocks.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import compress

from flashreinforce.buffer.ledger import Ledger
from flashreinforce.types import Generation, Prompt, RolloutKey, Trajectory

PromptAt = Callable[[int], Prompt]
GroupFilter = Callable[[list[Trajectory]], bool]


@dataclass(frozen=True)
class RolloutTask:
    """What to generate next, as handed to the controller by `Scheduler.admit`."""

    key: RolloutKey
    """(prompt_id, sample); sample in [0, G) the first time a prompt is seen, higher for re-queued attempts."""
    prompt: Prompt
    group: int
    """Data position of the prompt (U-RB data group = group // batch_groups)."""
    admitted_version: int
    """Policy version when this key was FIRST admitted; a resume keeps it. Lower-bounds every token version."""
    group_version: int | None
    """Policy version when the group's FIRST rollout was admitted. Siblings admitted later (after a weight
    push) share it, so every rollout of a group sees the same prompt (an AHRL hint is rendered at it). None
    only for a task restored from a checkpoint older than this field: it resumes from its partial."""
    partial: Generation | None = None
    """Resume from this partial generation (finish_reason "abort"); None for a fresh start."""


@dataclass(eq=False)  # identity: two attempts at one prompt are different groups
class Group:
    """One attempt at one prompt: its G keys and the state of each that is not waiting or in flight."""

    position: int
    prompt: Prompt
    keys: tuple[RolloutKey, ...]
    first_version: int | None = None
    """Policy version when the group's first rollout was admitted; None before that."""
    finished: dict[RolloutKey, Trajectory] = field(default_factory=dict)
    parked: dict[RolloutKey, RolloutTask] = field(default_factory=dict)
    """Aborted mid-generation; the task carries the partial and waits to be resumed."""

    @property
    def complete(self) -> bool:
        return len(self.finished) == len(self.keys)

    def trajectories(self) -> list[Trajectory]:
        """Finished rollouts in sample order."""
        return [self.finished[key] for key in self.keys if key in self.finished]


@dataclass
class FilterCounts:
    """Complete groups the group filter (DAPO dynamic sampling) kept and dropped over the run, by task ("" in a
    run without tasks). Checkpointed with the book, like the ledger's counts."""

    kept: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)

    def add(self, task: str, kept: bool) -> None:
        (self.kept if kept else self.dropped)[task] += 1

    def state_dict(self) -> dict:
        return {"kept": dict(self.kept), "dropped": dict(self.dropped)}

    @classmethod
    def from_state(cls, state: dict | None) -> FilterCounts:
        """None (a checkpoint written before these counts were kept): they start again from 0."""
        state = state or {}
        return cls(Counter(state.get("kept", {})), Counter(state.get("dropped", {})))


def filter_metrics(kept: Mapping[str, int], dropped: Mapping[str, int]) -> dict[str, float]:
    """dynamic_sampling/{kept,dropped}_groups, and per task of a mixture task/<name>/dynamic_sampling/...: every
    task that has had a group judged, with 0 for an outcome it never had. {} before any group is judged (or
    without a filter); a run without tasks gets the totals only, as its one task is all of them."""
    tasks = sorted(set(kept) | set(dropped))
    if not tasks:
        return {}
    metrics = {"dynamic_sampling/kept_groups": sum(kept.values()),
               "dynamic_sampling/dropped_groups": sum(dropped.values())}
    for task in filter(None, tasks):
        metrics[f"task/{task}/dynamic_sampling/kept_groups"] = kept.get(task, 0)
        metrics[f"task/{task}/dynamic_sampling/dropped_groups"] = dropped.get(task, 0)
    return metrics


class GroupBook:
    """Open groups, waiting and in-flight rollouts, and the ledger marks that go with moving between them."""

    def __init__(self, prompt_at: PromptAt, group_size: int, ledger: Ledger, first_position: int = 0) -> None:
        self.prompt_at = prompt_at
        self.group_size = group_size
        self.ledger = ledger
        self.cursor = first_position
        """Next data position to open (a later stage of a pipeline starts where its first step's data would be)."""
        self.groups: dict[int, Group] = {}
        """Open groups that are not complete yet, by position."""
        self.in_flight: dict[RolloutKey, RolloutTask] = {}
        self.cancelling: set[RolloutKey] = set()
        """Dropped while in flight; the controller still owes an on_finished or on_aborted for them."""
        self._waiting: list[tuple[int, int, RolloutKey]] = []  # sorted (position, sample, key)
        self._next_sample: dict[str, int] = {}  # prompt_id -> first unused sample (epochs, re-queues)
        self.resumed = 0
        """Parked rollouts handed out again, over the run."""
        self.filter_counts = FilterCounts()

    def continue_samples(self, next_sample: Mapping[str, int]) -> None:
        """Number each prompt's samples on from `next_sample` (a pipeline's earlier stages'), before any group
        opens, so that no key (nor the request seed drawn from it) is used twice in a pipeline."""
        assert not self.groups and not self._next_sample, "continue_samples goes before any group opens"
        self._next_sample = dict(next_sample)

    # -- opening groups and admitting rollouts ---------------------------------------------------------

    def open_next(self) -> Group:
        group = self.open(self.cursor, self.prompt_at(self.cursor))
        self.cursor += 1
        return group

    def open(self, position: int, prompt: Prompt) -> Group:
        """Open an attempt at `position` with G fresh keys (new sample numbers if the prompt was seen before)."""
        assert position not in self.groups, f"group {position} is already open"
        first = self._next_sample.get(prompt.id, 0)
        keys = tuple(RolloutKey(prompt.id, first + j) for j in range(self.group_size))
        self._next_sample[prompt.id] = first + self.group_size
        group = Group(position, prompt, keys)
        self.groups[position] = group
        for key in keys:
            bisect.insort(self._waiting, (position, key.sample, key))
        return group

    def admit(self, free_slots: int, version: int, may_open: Callable[[], bool]) -> list[RolloutTask]:
        """Up to free_slots tasks: waiting rollouts in (position, sample) order, then new groups while may_open()."""
        tasks: list[RolloutTask] = []
        while len(tasks) < free_slots:
            if not self._waiting:
                if not may_open():
                    break
                self.open_next()
                continue
            position, _, key = self._waiting.pop(0)
            group = self.groups[position]
            task = group.parked.pop(key, None)
            if task is None:
                if group.first_version is None:
                    group.first_version = version
                task = RolloutTask(key, group.prompt, position, version, group.first_version)
                self.ledger.schedule(key)
            else:
                self.resumed += 1
            self.in_flight[key] = task
            tasks.append(task)
        return tasks

    # -- results coming back ---------------------------------------------------------------------------

    def finish(self, trajectory: Trajectory) -> Group | None:
        """Record a finished rollout; return its group (removed from the open set) if that completes it."""
        key = trajectory.key
        if key in self.cancelling:  # it finished before the cancellation landed; it is already dropped
            self.cancelling.remove(key)
            return None
        task = self.in_flight.pop(key, None)
        if task is None:
            raise ValueError(f"on_finished: rollout {key} is not in flight (finished twice, or never admitted); "
                             "report each admitted task exactly once")
        if trajectory.group != task.group:
            self.in_flight[key] = task
            raise ValueError(f"on_finished: trajectory {key} has group {trajectory.group} but was admitted for "
                             f"data position {task.group}; copy RolloutTask.group into Trajectory.group")
        group = self.groups[task.group]
        group.finished[key] = trajectory
        if not group.complete:
            return None
        del self.groups[task.group]
        return group

    def park(self, task: RolloutTask, partial: Generation) -> None:
        """An aborted rollout waits to resume from `partial`, ahead of every later position."""
        key = task.key
        if key in self.cancelling:
            self.cancelling.remove(key)
            return
        own = self.in_flight.get(key)
        if own is None:
            raise ValueError(f"on_aborted: rollout {key} is not in flight; pass the task admit() returned")
        if partial.finish_reason != "abort":
            raise ValueError(f"on_aborted: rollout {key} came back with finish_reason {partial.finish_reason!r}; "
                             "a finished generation goes to on_finished as a Trajectory")
        del self.in_flight[key]
        self.groups[own.group].parked[key] = dataclasses.replace(own, partial=partial)
        bisect.insort(self._waiting, (own.group, key.sample, key))

    def retire(self, group: Group, reason: str) -> list[RolloutKey]:
        """Drop every admitted rollout of `group` (open or complete) with `reason`; forget the never-admitted.

        Returns the keys still in flight: the controller must cancel them (they are already dropped).
        """
        self.groups.pop(group.position, None)
        cancel = []
        for key in group.keys:
            if key in self.in_flight:
                del self.in_flight[key]
                self.cancelling.add(key)
                cancel.append(key)
                self.ledger.drop(key, reason)
            elif key in group.finished or key in group.parked:
                self.ledger.drop(key, reason)
            # else: never admitted, so never scheduled; it only leaves the waiting line below
        keys = set(group.keys)
        self._waiting = [w for w in self._waiting if w[2] not in keys]
        return cancel

    def keep(self, group: Group, group_filter: GroupFilter | None) -> bool:
        """Whether a complete group goes on to be trained; if not, it is dropped whole with the reason.

        A group with a rollout that sampled nothing (its environment's reset failed) is dropped first: that
        row can never be trained, and its siblings alone would give a group baseline over fewer rollouts than
        the group has, so it goes like a filtered group. Then the optional filter (DAPO dynamic sampling).
        """
        reason = untrainable(group.trajectories())
        if reason is None and group_filter is not None:
            kept = group_filter(group.trajectories())
            self.filter_counts.add(group.prompt.task, kept)
            reason = None if kept else "filtered"
        if reason is None:
            return True
        self.retire(group, reason)
        return False

    # -- queries ---------------------------------------------------------------------------------------

    def oldest_version(self, group: Group) -> int | None:
        """Lower bound on the policy version of any token this group will train on; None if nothing has run.

        Finished rollouts count with their stalest sampled token, admitted ones with their admission version.
        """
        versions = [trajectory_oldest(t) for t in group.finished.values()]
        versions += [t.admitted_version for t in group.parked.values()]
        versions += [self.in_flight[k].admitted_version for k in group.keys if k in self.in_flight]
        versions = [v for v in versions if v is not None]
        return min(versions) if versions else None

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_parked(self) -> int:
        return sum(len(g.parked) for g in self.groups.values())

    def stats(self) -> dict[str, float]:
        ledger = self.ledger.summary()
        return {"buffer/in_flight": len(self.in_flight), "buffer/waiting": self.num_waiting,
                "buffer/parked": self.num_parked, "buffer/open_groups": len(self.groups),
                "buffer/cursor": self.cursor, "buffer/resumed": self.resumed,
                **{f"buffer/{name.replace('/', '_')}": n for name, n in ledger.items()},
                **filter_metrics(self.filter_counts.kept, self.filter_counts.dropped)}

    # -- checkpoint ------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything, including what is in flight: those rollouts stay in flight across save -> restore."""
        return {"cursor": self.cursor, "next_sample": dict(self._next_sample), "resumed": self.resumed,
                "groups": [group_state(g) for g in self.groups.values()],
                "in_flight": [[t.key.prompt_id, t.key.sample, t.group, t.admitted_version, t.partial]
                              for t in self.in_flight.values()],
                "cancelling": sorted([k.prompt_id, k.sample] for k in self.cancelling),
                "filter_counts": self.filter_counts.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = state["cursor"]
        self._next_sample = dict(state["next_sample"])
        self.resumed = state["resumed"]
        self.filter_counts = FilterCounts.from_state(state.get("filter_counts"))
        self.groups = {}
        for entry in state["groups"]:
            group = group_from_state(entry, self.prompt_at)
            self.groups[group.position] = group
        self.in_flight = {}
        for prompt_id, sample, position, admitted_version, partial in state["in_flight"]:
            key, group = RolloutKey(prompt_id, sample), self.groups[position]
            assert key in group.keys, f"in-flight {key} is not a rollout of group {position}"
            self.in_flight[key] = RolloutTask(key, group.prompt, position, admitted_version,
                                              group.first_version, partial)
        self.cancelling = {RolloutKey(p, s) for p, s in state["cancelling"]}
        self._waiting = sorted((g.position, k.sample, k) for g in self.groups.values() for k in g.keys
                               if k not in g.finished and k not in self.in_flight)


def group_state(group: Group) -> dict:
    """Picklable: plain values plus the Trajectory/Generation records. The prompt is re-read from the data."""
    return {"position": group.position, "prompt_id": group.prompt.id, "samples": [k.sample for k in group.keys],
            "first_version": group.first_version,
            "finished": [group.finished[k] for k in group.keys if k in group.finished],
            "parked": [[t.key.sample, t.admitted_version, t.partial] for t in group.parked.values()]}


def group_from_state(state: dict, prompt_at: PromptAt) -> Group:
    position = state["position"]
    prompt = prompt_at(position)
    if prompt.id != state["prompt_id"]:
        raise ValueError(f"scheduler state: data position {position} held prompt {state['prompt_id']!r} but the "
                         f"data now gives {prompt.id!r}; resume with the same dataset, order and seed")
    # first_version is absent from checkpoints written before it existed: the next admission sets it.
    group = Group(position, prompt, tuple(RolloutKey(prompt.id, s) for s in state["samples"]),
                  state.get("first_version"))
    group.finished = {t.key: t for t in state["finished"]}
    for sample, admitted_version, partial in state["parked"]:
        key = RolloutKey(prompt.id, sample)
        group.parked[key] = RolloutTask(key, prompt, position, admitted_version, group.first_version, partial)
    return group


def untrainable(trajectories: list[Trajectory]) -> str | None:
    """Why a group cannot be trained, None if it can: a rollout with no sampled token ("env_error" when its
    environment failed before the first turn, else "empty")."""
    empty = [t for t in trajectories if not t.num_policy_tokens]
    if not empty:
        return None
    return "env_error" if any(t.finish_reason == "env_error" for t in empty) else "empty"


def trajectory_oldest(trajectory: Trajectory) -> int | None:
    """Version of the stalest sampled token, None when the policy sampled nothing (no lag to bound)."""
    return trajectory.oldest_version if trajectory.num_policy_tokens else None


def train_batch(groups: list[Group], ledger: Ledger, step: int) -> tuple[list[Trajectory], dict[str, float]]:
    """Mark every rollout of `groups` trained at `step`; return them by (group, sample) and their token lag.

    lag of a sampled token = step - its policy version; mean and max over the batch's sampled tokens.
    """
    batch = [t for g in sorted(groups, key=lambda g: g.position) for t in g.trajectories()]
    total = count = 0
    worst = 0
    for trajectory in batch:
        ledger.train(trajectory.key, step)
        versions = list(compress(trajectory.policy_versions, trajectory.loss_mask))
        if versions:
            total += step * len(versions) - sum(versions)
            count += len(versions)
            worst = max(worst, step - min(versions))
    return batch, {"buffer/lag_mean": total / count if count else 0.0, "buffer/lag_max": worst}


def check_step(version: int, last_step: int | None) -> None:
    """take_batch(version) trains at `version`; each version trains at most one batch."""
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"take_batch: version must be the number of optimizer steps taken (int >= 0), got {version!r}")
    if last_step is not None and version <= last_step:
        raise ValueError(f"take_batch(version={version}): a batch was already taken at version {last_step}; "
                         "step the learner, push the weights and pass the new version")


def scheduler_state(kind: str, options: dict, book: GroupBook, last_step: int | None, lag: dict, **own) -> dict:
    """A scheduler's checkpoint: what every kind saves (book, ledger, last step, lag), plus its own fields."""
    return {"kind": kind, "options": options, "book": book.state_dict(), "ledger": book.ledger.state_dict(),
            "last_step": last_step, "lag": dict(lag), **own}


def restore_scheduler_state(state: dict, kind: str, options: dict, book: GroupBook) -> tuple[int | None, dict]:
    """Load the common part of `scheduler_state` into `book` (and its ledger); returns (last_step, lag)."""
    check_state(state, kind, options)
    book.ledger.load_state_dict(state["ledger"])
    book.load_state_dict(state["book"])
    return state["last_step"], dict(state["lag"])


def check_state(state: dict, kind: str, options: dict) -> None:
    """A checkpoint restores only into a scheduler built with the same kind and options."""
    if state["kind"] != kind:
        raise ValueError(f"scheduler state is for scheduler.kind={state['kind']!r}, not {kind!r}; "
                         "resume with the kind the run was started with")
    for name, value in options.items():
        if state["options"][name] != value:
            raise ValueError(f"scheduler state has {name}={state['options'][name]!r} but this run has {value!r}; "
                             f"resume with {name}={state['options'][name]!r}")
