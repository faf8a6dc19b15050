"""stream: per-token lag <= max_staleness under both stale policies; drop re-queues, gate waits."""

import pytest
from buffer_sim import batch_order_ok, build, check_exactly_once, drive, finished, keys, partial, token_lags

B = 4


@pytest.mark.parametrize("stale_policy", ["gate", "drop"])
@pytest.mark.parametrize("max_staleness, group_size", [(0, 1), (1, 1), (2, 1), (1, 2)])
def test_stream_never_trains_a_token_older_than_max_staleness(stale_policy, max_staleness, group_size):
    S, dropped = max_staleness, 0
    for seed in range(10):
        def capacity(scheduler, tasks, version):
            assert scheduler.outstanding_groups <= (S + 1) * B

        trace = drive(build("stream", batch_groups=B, group_size=group_size, max_staleness=S,
                            stale_policy=stale_policy), steps=6, slots=3 + 2 * seed, seed=seed,
                      preempt=0.15 * (seed % 2), after_admit=capacity)
        check_exactly_once(trace, resolve_within=S)
        for version, batch in trace.batches:
            assert len(batch) == B * group_size and batch_order_ok(batch)
            assert max(token_lags(version, batch)) <= S, (seed, version)
        ledger = trace.scheduler.ledger
        assert set(ledger.dropped().values()) <= ({"stale"} if stale_policy == "drop" else set())
        requeued = {task.key for _, task in trace.admitted} | {
            k for g in trace.scheduler.book.groups.values() for k in g.keys}  # admitted, or waiting at the end
        for key in ledger.dropped():  # a dropped prompt is re-queued as new samples
            assert any(k.prompt_id == key.prompt_id and k.sample >= key.sample + group_size for k in requeued)
        dropped += len(ledger.dropped())
    # S=0 admits nothing while the learner trains, so nothing can go stale
    assert (dropped > 0) == (stale_policy == "drop" and S > 0)


def test_gate_waits_for_the_old_rollout_which_then_goes_first():
    s = build("stream", batch_groups=2, group_size=1, max_staleness=1)
    p0, p1, p2, p3 = s.admit(free_slots=8, version=0)  # (S+1) * B = 4 groups
    s.on_finished(finished(p2))
    s.on_finished(finished(p1))
    assert keys(s.take_batch(0)) == [("p1", 0), ("p2", 0)]  # p0, p3 can still make step 1
    assert s.on_version(1) == []
    p4, p5 = s.admit(free_slots=8, version=1)
    for task, versions in ((p4, (1,)), (p5, (1,)), (p3, (0, 1))):
        s.on_finished(finished(task, versions))
    assert s.take_batch(1) is None  # stepping with {p3, p4} would leave p0 (version 0) too old for step 2
    s.on_finished(finished(p0, versions=(0, 0, 1)))
    batch = s.take_batch(1)
    assert keys(batch) == [("p0", 0), ("p3", 0)] and max(token_lags(1, batch)) == 1
    assert s.ledger.summary() == {"scheduled": 6, "trained": 4, "outstanding": 2}


def test_gate_admission_keeps_every_deadline_reachable_while_the_learner_trains():
    """Regression: an (S+1)*B cap alone let a group start under the old weights during training; with B=1
    two groups were then due at step 1 and gate waited forever."""
    s = build("stream", batch_groups=1, group_size=1, max_staleness=1)
    p0, p1 = s.admit(free_slots=4, version=0)
    s.on_finished(finished(p0))
    assert keys(s.take_batch(0)) == [("p0", 0)]
    assert s.admit(free_slots=4, version=0) == []  # due by step 1 like p1, and step 1 has one slot
    assert keys(s.admit(free_slots=4, version=1)) == [("p2", 0)]  # due by step 2: fits
    s.on_finished(finished(p1))
    assert keys(s.take_batch(1)) == [("p1", 0)]


def test_drop_cancels_rollouts_that_can_no_longer_make_it_and_requeues_them_first():
    s = build("stream", batch_groups=1, group_size=1, max_staleness=1, stale_policy="drop")
    p0, p1 = s.admit(free_slots=4, version=0)
    s.on_finished(finished(p1))
    assert keys(s.take_batch(0)) == [("p1", 0)]
    assert s.on_version(1) == []  # p0 (version 0) can still train at step 1
    (p2,) = s.admit(free_slots=4, version=1)
    s.on_finished(finished(p2, versions=(1,)))
    assert keys(s.take_batch(1)) == [("p2", 0)]  # drop does not wait for p0
    assert s.on_version(2) == [("p0", 0)]  # a version-0 token would be 2 > S old at step 2
    assert s.ledger.status(p0.key) == "stale"
    s.on_aborted(p0, partial(p0, versions=(0, 0, 1)))  # the cancellation lands: nothing to resume
    retry, fresh = s.admit(free_slots=2, version=2)
    assert keys([retry, fresh]) == [("p0", 1), ("p3", 0)] and retry.group == 0 and retry.partial is None
    s.on_finished(finished(retry, versions=(2,)))
    assert keys(s.take_batch(2)) == [("p0", 1)]
    assert s.stats()["buffer/dropped_stale"] == 1 and s.ledger.summary()["trained"] == 3


def test_drop_tolerates_a_cancelled_rollout_that_finished_first():
    s = build("stream", batch_groups=1, group_size=2, max_staleness=0, stale_policy="drop")
    a, b = s.admit(free_slots=2, version=0)
    s.on_finished(finished(a))
    assert s.take_batch(0) is None
    assert s.on_version(1) == [("p0", 1)]  # the whole group goes: a is dropped too, b is cancelled
    assert s.ledger.dropped() == {a.key: "stale", b.key: "stale"}
    s.on_finished(finished(b))  # it finished before the cancellation reached the engine
    assert keys(s.admit(free_slots=2, version=1)) == [("p0", 2), ("p0", 3)]
    s.ledger.check()
    assert s.stats()["buffer/in_flight"] == 2 and s.stats()["buffer/ready_groups"] == 0


def test_drop_at_take_batch_catches_complete_groups_gone_stale():
    """A safety net for a version jump with no on_version in between: stale ready groups go, all of them."""
    s = build("stream", batch_groups=2, group_size=1, max_staleness=1, stale_policy="drop")
    p0, p1, p2, p3 = s.admit(free_slots=4, version=0)
    for task in (p0, p1, p2, p3):
        s.on_finished(finished(task))
    assert keys(s.take_batch(0)) == [("p0", 0), ("p1", 0)]
    assert s.take_batch(2) is None  # version-0 tokens would be 2 old
    assert s.ledger.dropped() == {p2.key: "stale", p3.key: "stale"}
    assert keys(s.admit(free_slots=4, version=2)) == [("p2", 1), ("p3", 1), ("p4", 0), ("p5", 0)]
