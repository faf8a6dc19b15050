"""APRIL properties 1-4 of ALGORITHMS.md §2 under random finish orders, preemptions and slow learners."""

import math
from statistics import mean

import pytest
from buffer_sim import batch_order_ok, build, check_exactly_once, drive, finished, keys, partial, target_length

from flashreinforce.buffer import mask_offpolicy_prefix
from flashreinforce.types import RolloutKey

B, G = 4, 3


def completion_order(trace) -> list[int]:
    """Groups in the order their last rollout finished."""
    left, order = {}, []
    for trajectory in trace.finished.values():
        left[trajectory.group] = left.get(trajectory.group, G) - 1
        if left[trajectory.group] == 0:
            order.append(trajectory.group)
    return order


@pytest.mark.parametrize("over_provision", [1.0, 2.0, 2.5])
def test_april_trains_the_first_b_groups_to_complete_and_discards_nothing(over_provision):
    resumed = 0
    for seed in range(12):
        highest = -1  # last data position admitted so far

        def head_first(scheduler, tasks, version):
            nonlocal resumed, highest
            assert len(scheduler.book.groups) <= math.ceil(over_provision * B)  # over-provisioning bound
            resumed_positions = [t.group for t in tasks if t.partial is not None]
            assert resumed_positions == sorted(resumed_positions)  # FIFO: oldest group first
            resumed += len(resumed_positions)
            if any(t.group > highest for t in tasks):
                assert scheduler.book.num_parked == 0  # a fresh prompt only once no aborted rollout waits
            highest = max([highest] + [t.group for t in tasks])

        trace = drive(build("april", batch_groups=B, group_size=G, over_provision=over_provision), steps=6,
                      slots=2 + seed % 10, seed=seed, preempt=0.1 * (seed % 2), after_admit=head_first)
        check_exactly_once(trace)
        assert trace.scheduler.ledger.dropped() == {}  # property 2: no sample discarded
        order = completion_order(trace)
        for k, (version, batch) in enumerate(trace.batches):
            groups = {t.group for t in batch}
            assert len(batch) == B * G and len(groups) == B  # property 1: B complete groups of G
            assert groups == set(order[k * B:(k + 1) * B])  # the first to complete, in completion order
            assert batch_order_ok(batch)
            for t in batch:  # finished siblings are kept as they were reported, never regenerated
                assert t is trace.finished[t.key]
        first_admission = {}
        for _, task in trace.admitted:  # property 3: a resume keeps key, admission version and partial
            first_admission.setdefault(task.key, task)
            assert task.admitted_version == first_admission[task.key].admitted_version
    assert resumed > 0


def test_april_hand_run_recycles_the_long_group_at_the_head():
    scheduler = build("april", batch_groups=2, group_size=1)
    tasks = scheduler.admit(free_slots=10, version=0)
    assert keys(tasks) == [(f"p{p}", 0) for p in range(4)]  # 2 x B groups in flight
    for task in tasks[1:3]:
        scheduler.on_finished(finished(task))
    assert keys(scheduler.take_batch(0)) == [("p1", 0), ("p2", 0)]  # short ones first: the bias
    fresh = scheduler.admit(free_slots=10, version=0)
    assert keys(fresh) == [("p4", 0), ("p5", 0)]  # back to 2 x B while the learner trains
    # the update: the controller aborts everything in flight, in whatever order
    in_flight = [tasks[3], fresh[1], tasks[0], fresh[0]]
    partials = {t.key: partial(t, versions=(0,) * (1 + t.group)) for t in in_flight}
    for task in in_flight:
        scheduler.on_aborted(task, partials[task.key])
    assert scheduler.on_version(1) == []
    resumed = scheduler.admit(free_slots=3, version=1)
    assert keys(resumed) == [("p0", 0), ("p3", 0), ("p4", 0)]  # FIFO by group, before any fresh prompt
    assert all(t.partial == partials[t.key] and t.admitted_version == 0 for t in resumed)
    assert keys(scheduler.admit(free_slots=3, version=1)) == [("p5", 0)]  # 4 groups open: no fresh one
    scheduler.on_finished(finished(resumed[1], versions=(0, 0, 0, 0, 1)))
    assert keys(scheduler.admit(free_slots=3, version=1)) == [("p6", 0)]
    stats = scheduler.stats()
    assert stats["buffer/resumed"] == 4 and stats["buffer/trained"] == 2 and "buffer/dropped_stale" not in stats
    assert stats["buffer/ready_groups"] == 1 and stats["buffer/open_groups"] == 4


def test_mask_offpolicy_keeps_only_the_segment_after_the_last_resume():
    scheduler = build("april", batch_groups=1, group_size=1)
    task = scheduler.admit(1, 0)[0]
    trajectory = finished(task, versions=(3, 3, 4, 4, 4))
    masked = mask_offpolicy_prefix(trajectory)
    assert masked.loss_mask == (0, 0, 0) + (0, 0, 1, 1, 1)
    assert masked.tokens == trajectory.tokens and masked.behavior_logprobs == trajectory.behavior_logprobs
    assert mask_offpolicy_prefix(finished(task, versions=(2, 2))).loss_mask == (0, 0, 0, 1, 1)  # no resume
    assert mask_offpolicy_prefix(finished(task, versions=())) == finished(task, versions=())


def test_april_mask_offpolicy_trains_only_newest_policy_tokens():
    masked_some = False
    for seed in range(10):
        trace = drive(build("april", batch_groups=B, group_size=2, mask_offpolicy=True), steps=5, slots=8,
                      seed=seed)
        check_exactly_once(trace)
        for version, batch in trace.batches:
            for t in batch:
                raw = trace.finished[t.key]
                sampled = [v for v, m in zip(raw.policy_versions, raw.loss_mask) if m]
                kept = [v for v, m in zip(t.policy_versions, t.loss_mask) if m]
                assert kept == [v for v in sampled if v == max(sampled)]
                masked_some |= len(kept) < len(sampled)
        version, batch = trace.batches[-1]  # lag is measured on the tokens actually trained
        lags = [version - v for t in batch for v, m in zip(t.policy_versions, t.loss_mask) if m]
        assert trace.scheduler.stats()["buffer/lag_max"] == max(lags)
    assert masked_some


def test_april_trains_short_rollouts_early_and_urb_does_not():
    """The bias APRIL accepts and U-RB removes, measured on the simulator's long-tailed lengths."""
    april, urb, data = [], [], []
    for seed in range(8):
        for kind, options, lengths in (("april", {}, april), ("urb", {"buffer_size": 2}, urb)):
            trace = drive(build(kind, batch_groups=8, group_size=1, **options), steps=3, slots=16, seed=seed)
            lengths += [target_length(t.key, seed) for _, b in trace.batches for t in b]
        data += [target_length(RolloutKey(f"p{p}", 0), seed) for p in range(24)]
    assert urb == data  # U-RB trains exactly the data order: the same lengths, nothing deferred
    assert mean(april) < 0.6 * mean(data), (mean(april), mean(data))
