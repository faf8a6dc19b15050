from collections import Counter

import pytest

from flashreinforce.data.order import MixedOrder, PromptOrder, whole_weights
from flashreinforce.types import Prompt


def _prompts(n):
    return [Prompt(id=f"p/{i}", prompt=f"q{i}", ground_truth=str(i)) for i in range(n)]


def test_each_epoch_is_a_permutation_and_epochs_differ():
    prompts = _prompts(50)
    order = PromptOrder(prompts, seed=3)
    epochs = [[order[e * 50 + j].id for j in range(50)] for e in range(3)]
    for ids in epochs:
        assert sorted(ids) == sorted(p.id for p in prompts)
    assert epochs[0] != epochs[1] != epochs[2]
    assert order.epoch_of(49) == 0 and order.epoch_of(50) == 1 and order.epoch_of(149) == 2
    assert order.epoch_size == 50


def test_order_is_a_function_of_the_seed_alone():
    # A resumed run rebuilds the order from the seed and a cursor, and may jump straight to epoch 7.
    prompts = _prompts(20)
    first, resumed = PromptOrder(prompts, seed=11), PromptOrder(prompts, seed=11)
    positions = [7 * 20 + 3, 2, 141, 0, 7 * 20 + 19]
    visited_in_order = {i: first[i] for i in sorted(positions)}
    assert [resumed[i] for i in positions] == [visited_in_order[i] for i in positions]
    assert [first[i].id for i in range(20)] != [PromptOrder(prompts, seed=12)[i].id for i in range(20)]


def test_pinned_order_stays_stable_across_versions():
    # Golden values recorded once: the shuffle reads only random.Random(str).random(), a stream Python
    # promises not to change, so a checkpoint's cursor means the same prompts after an upgrade.
    order = PromptOrder(_prompts(6), seed=0)
    assert [order.index_of(i) for i in range(12)] == [0, 5, 1, 4, 3, 2, 0, 3, 1, 5, 2, 4]


def test_no_shuffle_is_the_file_order():
    prompts = _prompts(4)
    order = PromptOrder(prompts, seed=0, shuffle=False)
    assert [order[i] for i in range(8)] == prompts + prompts


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        PromptOrder([], seed=0)
    with pytest.raises(ValueError, match="'p/1' appears more than once"):
        PromptOrder(_prompts(3) + _prompts(2)[1:], seed=0)
    order = PromptOrder(_prompts(3), seed=0)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="int >= 0"):
            order[bad]


def _mixture(seed=0, weights=None):
    orders = {"math": PromptOrder(_prompts(7), seed=1), "tool": PromptOrder([Prompt(id=f"t/{i}", prompt="", ground_truth="")
                                                                             for i in range(5)], seed=2)}
    return MixedOrder(orders, weights or {"math": 3, "tool": 1}, seed=seed)


def test_a_mixture_follows_the_weights_exactly_every_cycle_and_each_task_its_own_order():
    order = _mixture()
    assert order.period == 4
    tasks = [order.task_at(i) for i in range(400)]
    for c in range(100):  # every cycle of 4 positions: 3 math, 1 tool
        assert sorted(tasks[4 * c: 4 * c + 4]) == ["math", "math", "math", "tool"]
    assert tasks[:40] != ["math", "math", "math", "tool"] * 10  # shuffled within cycles, not a fixed pattern
    math_ids = [order[i].id for i in range(400) if tasks[i] == "math"]
    assert math_ids == [order.orders["math"][k].id for k in range(300)]  # the task's own seeded order, in turn
    tool_ids = [order[i].id for i in range(400) if tasks[i] == "tool"]
    assert tool_ids == [order.orders["tool"][k].id for k in range(100)]


def test_a_mixture_is_a_function_of_the_seed_and_the_position_alone():
    """What a resumed run relies on: a fresh order maps every position to the same (task, prompt), in any visiting
    order; another seed interleaves differently."""
    first, resumed = _mixture(seed=5), _mixture(seed=5)
    positions = [1003, 2, 57, 0, 1003, 401]
    expected = {i: (first.locate(i), first[i].id) for i in sorted(set(positions))}
    assert [(resumed.locate(i), resumed[i].id) for i in positions] == [expected[i] for i in positions]
    assert [first.task_at(i) for i in range(40)] != [_mixture(seed=6).task_at(i) for i in range(40)]


@pytest.mark.parametrize(("weights", "shares"), [({"a": 3, "b": 1, "c": 1}, {"a": 3, "b": 1, "c": 1}),
                                                ({"a": 0.7, "b": 0.3}, {"a": 7, "b": 3}),
                                                ({"a": 1 / 3, "b": 2 / 3}, {"a": 1, "b": 2}),
                                                ({"a": 1.0, "b": 1e-6}, {"a": 1000, "b": 1})])
def test_weights_become_the_smallest_whole_shares_and_no_task_is_left_out(weights, shares):
    assert whole_weights(weights) == shares


def test_empirical_shares_of_a_long_run_match_fractional_weights():
    orders = {name: PromptOrder(_prompts(3), seed=0) for name in ("a", "b", "c")}
    order = MixedOrder(orders, {"a": 0.5, "b": 0.3, "c": 0.2}, seed=0)
    counts = Counter(order.task_at(i) for i in range(1000))
    assert counts == {"a": 500, "b": 300, "c": 200}
    counts = Counter(order.task_at(i) for i in range(137))  # not a whole number of cycles: within one cycle
    assert all(abs(counts[t] - 137 * w) <= order.period for t, w in {"a": 0.5, "b": 0.3, "c": 0.2}.items())


def test_positions_before_count_each_tasks_share_and_a_continued_order_goes_on_from_there():
    """A pipeline's later stage: each task's own order goes on where the earlier stage's mixture left it."""
    from flashreinforce.data.order import ContinuedOrder

    order = _mixture()
    for i in (0, 1, 3, 4, 5, 17, 400):
        counts = order.positions_before(i)
        assert counts == {name: [order.task_at(j) for j in range(i)].count(name) for name in ("math", "tool")}
    stood = order.positions_before(17)
    later = MixedOrder({name: ContinuedOrder(order.orders[name], stood[name]) for name in order.orders},
                       {"math": 1, "tool": 1}, seed=9)
    math_next = [later[i].id for i in range(40) if later.task_at(i) == "math"]
    assert math_next == [order.orders["math"][stood["math"] + k].id for k in range(len(math_next))]
    epoch_start = stood["math"] - stood["math"] % 7  # math has 7 prompts: the rest of this epoch is none seen in it
    seen = {order.orders["math"][k].id for k in range(epoch_start, stood["math"])}
    assert seen and not set(math_next[:7 - stood["math"] % 7]) & seen
    with pytest.raises(ValueError, match="start must be an int >= 0"):
        ContinuedOrder(order.orders["math"], -1)
