"""U-RB properties 1-4 of ALGORITHMS.md §1.1 under random finish orders, preemptions and slow learners."""

import pytest
from buffer_sim import batch_order_ok, build, check_exactly_once, drive, finished, keys, token_lags

B = 4


def d_t(t: int, group_size: int) -> list[tuple[str, int]]:
    return [(f"p{p}", s) for p in range(t * B, (t + 1) * B) for s in range(group_size)]


@pytest.mark.parametrize("buffer_size, group_size", [(1, 1), (2, 1), (3, 2), (2, 3)])
def test_urb_batch_t_is_exactly_d_t_and_nothing_runs_more_than_n_minus_1_ahead(buffer_size, group_size):
    N = buffer_size
    ran_ahead = resumed = 0
    for seed in range(12):
        def window(scheduler, tasks, version):
            nonlocal ran_ahead
            assert scheduler.queries_in_infer <= B * N  # property 3
            for task in tasks:
                group = task.group // B
                assert group <= min(scheduler.iteration, version) + N - 1, (task, version, scheduler.iteration)
                ran_ahead += group > scheduler.iteration

        trace = drive(build("urb", batch_groups=B, group_size=group_size, buffer_size=N), steps=6,
                      slots=2 + seed % 9, seed=seed, preempt=0.2 * (seed % 2), after_admit=window)
        check_exactly_once(trace, resolve_within=N - 1)  # property 4: nothing lost or duplicated
        for t, (version, batch) in enumerate(trace.batches):
            assert version == t and keys(batch) == d_t(t, group_size)  # properties 1 and 2, in order
            assert max(token_lags(version, batch)) <= N - 1  # property 4
        resumed += sum(task.partial is not None for _, task in trace.admitted)
    assert (ran_ahead > 0) == (N > 1)  # N > 1 really generates future groups; N = 1 never does
    assert resumed > 0  # preempted rollouts were resumed (FakeEngine asserts their partials are intact)


def test_urb_with_n_1_is_sync():
    for seed in range(10):
        runs = [drive(build(kind, batch_groups=B, group_size=2, **options), steps=5, slots=3 + seed, seed=seed,
                      preempt=0.1)
                for kind, options in (("urb", {"buffer_size": 1}), ("sync", {}))]
        assert runs[0].summary() == runs[1].summary()


def test_urb_figure_5_the_long_query_is_waited_for_and_future_work_waits():
    """ERNIE Fig. 5 in small: D_0 = p0..p3, p2 is long; free slots run D_1, which must not enter batch 0."""
    scheduler = build("urb", batch_groups=4, group_size=1, buffer_size=2)
    first = scheduler.admit(free_slots=4, version=0)
    assert keys(first) == [("p0", 0), ("p1", 0), ("p2", 0), ("p3", 0)]
    for task in (first[0], first[1], first[3]):
        scheduler.on_finished(finished(task))
    future = scheduler.admit(free_slots=3, version=0)
    assert keys(future) == [("p4", 0), ("p5", 0), ("p6", 0)]
    scheduler.on_finished(finished(future[0]))
    scheduler.on_finished(finished(future[1]))
    assert scheduler.take_batch(0) is None  # APRIL would train p0, p1, p3, p4 now
    scheduler.on_finished(finished(first[2], versions=(0, 0, 0, 0)))
    assert keys(scheduler.take_batch(0)) == [("p0", 0), ("p1", 0), ("p2", 0), ("p3", 0)]
    # while the learner trains D_0 the engine holds version 0: the window is still groups [0, 1]
    assert keys(scheduler.admit(free_slots=8, version=0)) == [("p7", 0)]
    assert scheduler.queries_in_infer == 4
    assert keys(scheduler.admit(free_slots=8, version=1)) == [(f"p{p}", 0) for p in range(8, 12)]
    assert scheduler.queries_in_infer == 8 == 4 * 2  # B * N
    assert scheduler.take_batch(1) is None  # p6 and p7 still running


def test_urb_filter_stays_inside_d_t_and_an_all_filtered_d_t_gives_an_empty_batch():
    def keep(group):  # all of D_1 and every fifth prompt are rejected
        position = group[0].group
        return position // B != 1 and position % 5 != 0

    for seed in range(10):
        trace = drive(build("urb", batch_groups=B, group_size=2, buffer_size=2, group_filter=keep), steps=3,
                      slots=5, seed=seed, preempt=0.1)
        check_exactly_once(trace, resolve_within=1)
        assert [v for v, _ in trace.batches] == [0, 1, 1, 2]  # [] for D_1 is not a step: the version stays
        assert [sorted({t.group for t in b}) for _, b in trace.batches] == [[1, 2, 3], [], [8, 9, 11], [12, 13, 14]]
        assert all(batch_order_ok(b) for _, b in trace.batches)
        filtered = {k for k, r in trace.scheduler.ledger.dropped().items() if r == "filtered"}
        assert {k.prompt_id for k in filtered} >= {"p0", "p4", "p5", "p6", "p7", "p10"}


@pytest.mark.parametrize("buffer_size", [1, 2, 3])
def test_urb_goes_on_through_any_number_of_fully_filtered_data_groups(buffer_size):
    """Each all-filtered D_t takes no optimizer step; it must not shrink the look-ahead for the rest of the run."""
    N, filtered_groups = buffer_size, {1, 2, 4, 6, 7, 9}

    def keep(group):  # these data groups are filtered out whole, and every third prompt elsewhere
        position = group[0].group
        return position // B not in filtered_groups and position % 3 != 0

    for seed in range(6):
        def window(scheduler, tasks, version):
            assert scheduler.queries_in_infer <= B * N
            for task in tasks:  # never more than N-1 versions ahead of the version that will train it
                assert task.group // B <= version + scheduler.skipped + N - 1, (task, version, scheduler.skipped)

        trace = drive(build("urb", batch_groups=B, group_size=2, buffer_size=N, group_filter=keep), steps=5,
                      slots=3 + seed, seed=seed, preempt=0.1, after_admit=window)
        check_exactly_once(trace, resolve_within=N - 1)
        trained = [(v, b) for v, b in trace.batches if b]
        assert [v for v, _ in trained] == [0, 1, 2, 3, 4]
        assert len(trace.batches) == 5 + len(filtered_groups)  # every D_t, the filtered ones as []
        for t, (version, batch) in enumerate(trace.batches):  # iteration t trains exactly its filtered D_t
            expected = [] if t in filtered_groups else [p for p in range(t * B, (t + 1) * B) if p % 3 != 0]
            assert sorted({x.group for x in batch}) == expected
            assert not batch or max(token_lags(version, batch)) <= N - 1
        assert trace.scheduler.skipped == len(filtered_groups)


@pytest.mark.parametrize("buffer_size", [1, 2, 3])
def test_urb_in_a_later_stage_trains_d_t_from_its_first_step_within_the_same_lag(buffer_size):
    """A pipeline's stage whose first step follows step 5: D_5, D_6, ... in order, nothing more than N-1 ahead of
    the engine's weights (the window counts from the stage's own start, not from 0)."""
    N, first = buffer_size, 5
    for seed in range(8):
        def window(scheduler, tasks, version):
            assert all(task.group // B <= min(scheduler.iteration, version) + N - 1 for task in tasks)

        trace = drive(build("urb", batch_groups=B, group_size=2, buffer_size=N, first_step=first), steps=4,
                      slots=2 + seed, seed=seed, preempt=0.2, after_admit=window, first_step=first)
        check_exactly_once(trace, resolve_within=N - 1)
        for t, (version, batch) in enumerate(trace.batches, start=first):
            assert version == t and keys(batch) == d_t(t, 2)
            assert max(token_lags(version, batch)) <= N - 1
