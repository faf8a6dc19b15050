"""A seeded simulator that drives a scheduler the way the controller does, with a fake engine.

The fake engine has `slots` decoding slots; every tick each running rollout emits a token with some
probability, stamped with the engine's current version, and finishes at a length drawn per key from a
long-tailed distribution. The driver interleaves admission, finishes, random preemptions, a learner that
takes a while to train (the engine keeps decoding the old version meanwhile), weight updates, april's
abort-all, stream's cancellations, and optionally a pause -> state_dict -> restore in a new scheduler.
Everything is a function of the seed and of the scheduler's answers, so two runs can be compared exactly.
"""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass, field
from collections.abc import Callable

from flashreinforce.buffer import RolloutTask, Scheduler, build_scheduler
from flashreinforce.types import (FORCED_VERSION, Generation, Prompt, RolloutKey, SamplingParams, Trajectory,
                                  Verdict)

PROMPT_IDS = (7, 8, 9)


def make_prompt_at(distinct: int | None = None) -> Callable[[int], Prompt]:
    """Data order p0, p1, ...; with `distinct`, ids repeat every `distinct` positions (epochs)."""
    def prompt_at(i: int) -> Prompt:
        return Prompt(id=f"p{i % distinct if distinct else i}", prompt=f"question {i}", ground_truth="0")
    return prompt_at


def target_length(key: RolloutKey, seed: int) -> int:
    """Long-tailed: most rollouts short, one in five up to ~8x longer."""
    rng = random.Random(f"{seed}/{key.prompt_id}/{key.sample}")
    return rng.randint(1, 6) if rng.random() < 0.8 else rng.randint(10, 40)


def reward(key: RolloutKey, seed: int) -> float:
    return float(random.Random(f"r{seed}/{key.prompt_id}/{key.sample}").random() < 0.5)


def finished(task: RolloutTask, versions: tuple[int, ...] = (0,), reward: float = 1.0) -> Trajectory:
    """A hand-made finished rollout of `task` whose sampled tokens carry `versions`."""
    n = len(versions)
    return Trajectory(task.key, task.prompt, task.group, PROMPT_IDS + tuple(range(n)),
                      (0,) * len(PROMPT_IDS) + (1,) * n, (0.0,) * len(PROMPT_IDS) + (-1.0,) * n,
                      (FORCED_VERSION,) * len(PROMPT_IDS) + tuple(versions), len(PROMPT_IDS), "stop",
                      Verdict(reward, passed=reward > 0))


def partial(task: RolloutTask, versions: tuple[int, ...]) -> Generation:
    """A hand-made partial generation of `task` (aborted after len(versions) tokens)."""
    n = len(versions)
    return Generation(f"{task.key.prompt_id}/{task.key.sample}", PROMPT_IDS, tuple(range(n)), (-1.0,) * n,
                      tuple(versions), (1,) * n, "abort", SamplingParams())


def keys(items) -> list[tuple[str, int]]:
    """Tasks or trajectories as plain (prompt_id, sample) pairs, for readable asserts."""
    return [tuple(item.key) for item in items]


def behavior_logprob(key: RolloutKey, index: int, version: int) -> float:
    return -0.01 * (index + 1) - 0.001 * version - 0.0001 * key.sample


@dataclass
class _Run:
    task: RolloutTask
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    target: int


class FakeEngine:
    def __init__(self, slots: int, seed: int) -> None:
        self.slots, self.seed, self.version = slots, seed, 0
        self.running: dict[RolloutKey, _Run] = {}
        self.aborted: dict[RolloutKey, Generation] = {}  # what each parked key must resume from

    @property
    def free_slots(self) -> int:
        return self.slots - len(self.running)

    def submit(self, task: RolloutTask) -> None:
        assert len(self.running) < self.slots, "scheduler admitted more tasks than free slots"
        self.resume(task, task.partial)

    def resume(self, task: RolloutTask, partial: Generation | None) -> None:
        """Continue `task` from `partial`, which must be exactly what it was aborted with (prefix, log-probs,
        versions), or start it fresh if it never ran."""
        assert task.key not in self.running, f"{task.key} admitted while running"
        expected = self.aborted.pop(task.key, None)
        assert partial == expected, f"{task.key}: resumed from {partial}, aborted as {expected}"
        p = partial
        self.running[task.key] = _Run(task, list(p.token_ids) if p else [], list(p.behavior_logprobs) if p else [],
                                      list(p.policy_versions) if p else [], target_length(task.key, self.seed))

    def tick(self, rng: random.Random) -> list[Trajectory]:
        finished = []
        for key in sorted(self.running):
            run = self.running[key]
            if rng.random() < 0.7:
                run.tokens.append(len(run.tokens) % 50)
                run.logprobs.append(behavior_logprob(key, len(run.logprobs), self.version))
                run.versions.append(self.version)
            if len(run.tokens) >= run.target:
                del self.running[key]
                finished.append(self._trajectory(run))
        return finished

    def _trajectory(self, run: _Run) -> Trajectory:
        n, task = len(run.tokens), run.task
        return Trajectory(key=task.key, prompt=task.prompt, group=task.group, tokens=PROMPT_IDS + tuple(run.tokens),
                          loss_mask=(0,) * len(PROMPT_IDS) + (1,) * n,
                          behavior_logprobs=(0.0,) * len(PROMPT_IDS) + tuple(run.logprobs),
                          policy_versions=(FORCED_VERSION,) * len(PROMPT_IDS) + tuple(run.versions),
                          prompt_length=len(PROMPT_IDS), finish_reason="stop",
                          verdict=Verdict(reward=reward(task.key, self.seed), passed=True))

    def abort(self, key: RolloutKey) -> tuple[RolloutTask, Generation]:
        run = self.running.pop(key)
        partial = Generation(request_id=f"{key.prompt_id}/{key.sample}", prompt_ids=PROMPT_IDS,
                             token_ids=tuple(run.tokens), behavior_logprobs=tuple(run.logprobs),
                             policy_versions=tuple(run.versions), loss_mask=(1,) * len(run.tokens),
                             finish_reason="abort", params=SamplingParams())
        self.aborted[key] = partial
        return run.task, partial

    def abort_all(self) -> list[tuple[RolloutTask, Generation]]:
        return [self.abort(key) for key in sorted(self.running)]


@dataclass
class Trace:
    """What happened, in order: enough to compare two runs and to check the properties."""

    batches: list[tuple[int, list[Trajectory]]] = field(default_factory=list)  # (trained at version, batch)
    admitted: list[tuple[int, RolloutTask]] = field(default_factory=list)  # (tick, task)
    finished: dict[RolloutKey, Trajectory] = field(default_factory=dict)
    aborted: list[tuple[int, RolloutKey]] = field(default_factory=list)
    cancelled: list[RolloutKey] = field(default_factory=list)
    scheduler: Scheduler | None = None  # the one that ended the run (a restored one after a restore)
    paused_at: int | None = None
    ticks: int = 0

    def summary(self) -> tuple:
        return ([(v, [t.key for t in b]) for v, b in self.batches], [(i, t.key, t.partial) for i, t in self.admitted],
                self.aborted, self.cancelled)


def drive(scheduler: Scheduler, *, steps: int, slots: int, seed: int, preempt: float = 0.0,
          pause_at: int | None = None, hand_back: bool = False, rebuild: Callable[[dict], Scheduler] | None = None,
          after_admit: Callable[[Scheduler, list[RolloutTask], int], None] | None = None,
          max_ticks: int = 20_000, first_step: int = 0) -> Trace:
    """Run until `steps` optimizer steps are taken. after_admit(scheduler, tasks, engine version) checks
    invariants at every admission. At tick `pause_at` the engine is paused and state_dict() taken, the way
    the controller checkpoints: the partials are kept beside the state and resubmitted after (with
    `hand_back`, they go to on_aborted instead and come back through admit). With `rebuild`, the run
    continues in rebuild(pickled copy of the state) with pickled copies of the partials. first_step: the
    version the engine and learner start at (a pipeline's later stage)."""
    rng = random.Random(seed)
    engine = FakeEngine(slots, seed)
    engine.version = first_step
    trace = Trace()
    version, training_for, tick = first_step, None, 0  # training_for: ticks until the learner's update lands
    while version < first_step + steps:
        tick += 1
        assert tick < max_ticks, f"no progress after {tick} ticks at version {version}: {scheduler.stats()}"
        if tick == pause_at:
            paused = engine.abort_all()
            if hand_back:
                for task, partial in paused:
                    scheduler.on_aborted(task, partial)
                    trace.aborted.append((tick, task.key))
                paused = []
            state = scheduler.state_dict()
            trace.paused_at = tick
            if rebuild is not None:
                scheduler = rebuild(pickle.loads(pickle.dumps(state)))
                paused = pickle.loads(pickle.dumps(paused))
            for task, partial in paused:
                engine.resume(task, partial)
        tasks = scheduler.admit(engine.free_slots, engine.version)
        for task in tasks:
            engine.submit(task)
            trace.admitted.append((tick, task))
        if after_admit is not None:
            after_admit(scheduler, tasks, engine.version)
        for trajectory in engine.tick(rng):
            trace.finished[trajectory.key] = trajectory
            scheduler.on_finished(trajectory)
        if preempt and engine.running and rng.random() < preempt:
            task, partial = engine.abort(rng.choice(sorted(engine.running)))
            scheduler.on_aborted(task, partial)
            trace.aborted.append((tick, task.key))
        if training_for is None and rng.random() < 0.8:
            batch = scheduler.take_batch(version)
            if batch is not None:
                trace.batches.append((version, batch))
                if batch:  # [] (urb, all filtered): no step, same version
                    training_for = rng.randint(0, 3)
        elif training_for is not None:
            training_for -= 1
            if training_for < 0:
                training_for = None
                version += 1
                engine.version = version
                if scheduler.abort_on_update:
                    for task, partial in engine.abort_all():
                        scheduler.on_aborted(task, partial)
                        trace.aborted.append((tick, task.key))
                for key in scheduler.on_version(version):
                    task, partial = engine.abort(key)
                    engine.aborted.pop(key)  # cancelled: never resumed
                    scheduler.on_aborted(task, partial)
                    trace.cancelled.append(key)
    trace.scheduler, trace.ticks = scheduler, tick
    return trace


def build(kind: str, *, batch_groups: int, group_size: int, distinct: int | None = None, **options) -> Scheduler:
    return build_scheduler(kind, prompt_at=make_prompt_at(distinct), batch_groups=batch_groups,
                           group_size=group_size, **options)


def restorer(kind: str, **kwargs) -> Callable[[dict], Scheduler]:
    def rebuild(state: dict) -> Scheduler:
        scheduler = build(kind, **kwargs)
        scheduler.load_state_dict(state)
        return scheduler
    return rebuild


def check_exactly_once(trace: Trace, resolve_within: int | None = None) -> None:
    """The ledger agrees with what was actually trained, and nothing was trained twice or lost.

    resolve_within: every rollout is trained or dropped by step v + resolve_within, v = the version of its
    oldest token (its admission version while unfinished); a forgotten rollout would stay outstanding."""
    scheduler = trace.scheduler
    scheduler.ledger.check()
    if resolve_within is not None:
        steps = sum(1 for _, batch in trace.batches if batch)
        late = []
        for _, task in trace.admitted:
            done = trace.finished.get(task.key)
            anchor = done.oldest_version if done else task.admitted_version
            if anchor + resolve_within < steps and scheduler.ledger.status(task.key) is None:
                late.append(task.key)
        assert not late, f"unresolved {resolve_within} steps after their oldest token: {late}"
    trained = [(t.key, v) for v, batch in trace.batches for t in batch]
    assert len({k for k, _ in trained}) == len(trained), "a rollout was trained twice"
    assert dict(trained) == scheduler.ledger.trained()
    admitted = {task.key for _, task in trace.admitted}
    assert admitted == set(scheduler.ledger.trained()) | set(scheduler.ledger.dropped()) | set(
        scheduler.ledger.outstanding())
    assert set(scheduler.ledger.dropped()).isdisjoint(scheduler.ledger.trained())
    for _, batch in trace.batches:
        for t in batch:  # a trained rollout is the one the engine finished (masking aside)
            assert t.tokens == trace.finished[t.key].tokens


def batch_order_ok(batch: list[Trajectory]) -> bool:
    return [(t.group, t.key.sample) for t in batch] == sorted((t.group, t.key.sample) for t in batch)


def token_lags(version: int, batch: list[Trajectory]) -> list[int]:
    return [version - v for t in batch for v, m in zip(t.policy_versions, t.loss_mask) if m]
