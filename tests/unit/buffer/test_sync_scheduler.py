import pytest
from buffer_sim import batch_order_ok, build, check_exactly_once, drive, finished, keys, token_lags

from flashreinforce.types import RolloutKey

B = 4


@pytest.mark.parametrize("group_size", [1, 3])
def test_sync_trains_exactly_the_b_groups_in_order_under_random_finishes(group_size):
    for seed in range(15):
        def no_look_ahead(scheduler, tasks, version):
            for task in tasks:  # iteration t's prompts start only once the engine holds version t
                if task.partial is None:
                    assert task.group // B == version == task.admitted_version, (task, version)

        trace = drive(build("sync", batch_groups=B, group_size=group_size), steps=6, slots=1 + seed % 7,
                      seed=seed, preempt=0.15 * (seed % 2), after_admit=no_look_ahead)
        check_exactly_once(trace, resolve_within=0)
        for t, (version, batch) in enumerate(trace.batches):
            assert version == t
            assert [k.key for k in batch] == [RolloutKey(f"p{p}", s) for p in range(t * B, (t + 1) * B)
                                              for s in range(group_size)]
            assert set(token_lags(version, batch)) == {0}  # fully on-policy
        assert trace.scheduler.ledger.summary()["outstanding"] == 0  # nothing runs ahead


def test_sync_hand_run_waits_for_the_slowest_and_for_the_new_weights():
    scheduler = build("sync", batch_groups=2, group_size=1)
    tasks = scheduler.admit(free_slots=5, version=0)
    assert keys(tasks) == [("p0", 0), ("p1", 0)]  # only this iteration, however many slots are free
    scheduler.on_finished(finished(tasks[1]))
    assert scheduler.take_batch(0) is None  # p0, the slow one, is still decoding
    scheduler.on_finished(finished(tasks[0]))
    assert keys(scheduler.take_batch(0)) == [("p0", 0), ("p1", 0)]
    assert scheduler.admit(free_slots=5, version=0) == []  # learner training: nothing under the old weights
    assert keys(scheduler.admit(free_slots=1, version=1)) == [("p2", 0)]
    assert keys(scheduler.admit(free_slots=1, version=1)) == [("p3", 0)]
    assert scheduler.admit(free_slots=1, version=1) == []
    stats = scheduler.stats()
    assert stats["buffer/in_flight"] == 2 and stats["buffer/trained"] == 2 and stats["buffer/lag_max"] == 0


def test_sync_filter_replaces_rejected_groups_with_the_next_prompts():
    def keep(group):  # DAPO-style: keep groups whose rewards are not all equal
        return len({t.reward for t in group}) > 1

    for seed in range(10):
        trace = drive(build("sync", batch_groups=B, group_size=3, group_filter=keep), steps=4, slots=5, seed=seed,
                      preempt=0.1)
        check_exactly_once(trace, resolve_within=0)
        ledger = trace.scheduler.ledger
        filtered = {k.prompt_id for k, reason in ledger.dropped().items() if reason == "filtered"}
        assert set(ledger.dropped().values()) <= {"filtered"}
        seen = []
        for version, batch in trace.batches:
            groups = sorted({t.group for t in batch})
            assert len(groups) == B and all(len([t for t in batch if t.group == g]) == 3 for g in groups)
            assert all(keep([t for t in batch if t.group == g]) for g in groups)
            assert batch_order_ok(batch) and set(token_lags(version, batch)) == {0}
            seen += groups
        # data order kept: every position up to the last trained one was trained or filtered
        assert seen == sorted(seen)
        assert {f"p{p}" for p in range(seen[-1] + 1)} == {f"p{g}" for g in seen} | filtered
