"""Advantage estimators: hand-derived values and the ALGORITHMS.md section 7 properties."""

import math

import pytest
import torch

from flashreinforce.algorithms.advantages import (
    batch_mean_advantages,
    drgrpo_advantages,
    group_mean,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)

R = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0], dtype=torch.float64)
GROUPS = torch.tensor([7, 7, 7, 7, 2, 2])  # ids need not be contiguous or sorted


def test_group_mean_with_arbitrary_ids():
    torch.testing.assert_close(group_mean(torch.tensor([1.0, 0.0, 4.0, 2.0]), torch.tensor([7, 3, 7, 3])),
                               torch.tensor([2.5, 1.0, 2.5, 1.0]))


def test_batch_mean_ignores_groups():
    torch.testing.assert_close(batch_mean_advantages(R, GROUPS), R - 5 / 6)


def test_grpo_hand_values():
    # group 7: mean 0.25, sample std sqrt(0.75/3) = 0.5; group 2: mean 2, std sqrt(2)
    expected = torch.tensor([0.75 / 0.5, -0.5, -0.5, -0.5, 1 / math.sqrt(2), -1 / math.sqrt(2)], dtype=torch.float64)
    torch.testing.assert_close(grpo_advantages(R, GROUPS), expected, rtol=1e-5, atol=0)


def test_grpo_constant_group_gets_zero_advantage():
    advantages = grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert advantages[:2].eq(0).all() and advantages[2] < 0 < advantages[3]


def test_drgrpo_is_group_centered_reward():
    torch.testing.assert_close(drgrpo_advantages(R, GROUPS),
                               torch.tensor([0.75, -0.25, -0.25, -0.25, 1.0, -1.0], dtype=torch.float64))


def test_grpo_and_drgrpo_signs_agree_and_are_equal_when_std_is_one():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 4, (12,), generator=g).double()
    groups = torch.arange(12) // 4
    assert torch.equal(torch.sign(grpo_advantages(rewards, groups)), torch.sign(drgrpo_advantages(rewards, groups)))
    # a pair sqrt(2) apart has sample std exactly 1, so GRPO = Dr.GRPO up to the 1e-6 in the denominator
    pairs = torch.tensor([0.0, math.sqrt(2), 4.0, 4.0 + math.sqrt(2)], dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 1])
    torch.testing.assert_close(grpo_advantages(pairs, ids), drgrpo_advantages(pairs, ids), rtol=2e-6, atol=0)


def test_rloo_leave_one_out_values_and_identities():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1])
    advantages = rloo_advantages(rewards, groups)
    # group 0: 1 - 0, 0 - 0.5, 0 - 0.5; group 1: 2 - 4, 4 - 2
    torch.testing.assert_close(advantages, torch.tensor([1.0, -0.5, -0.5, -2.0, 2.0], dtype=torch.float64))
    assert abs(float(advantages[:3].sum())) < 1e-12 and abs(float(advantages[3:].sum())) < 1e-12
    k = torch.tensor([3.0, 3, 3, 2, 2], dtype=torch.float64)
    torch.testing.assert_close(advantages, k / (k - 1) * drgrpo_advantages(rewards, groups))


def test_rloo_rejects_a_group_of_one():
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))


def test_singleton_groups_warn_because_they_carry_no_signal():
    with pytest.warns(RuntimeWarning, match="single rollout"):
        advantages = grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]))
    assert advantages.eq(0).all()


def openrlhf_whitened(rewards, lengths):
    """OpenRLHF's REINFORCE++ normalisation, written out on the token level: each row's per-token return is its
    reward (gamma 1, no KL); mean and variance over every action token of the batch; (x - mean) * rsqrt(var)."""
    returns = torch.cat([torch.full((n,), float(r), dtype=torch.float64) for r, n in zip(rewards, lengths)])
    mean = returns.mean()
    rstd = ((returns - mean).pow(2).mean()).clamp(min=1e-8).rsqrt()
    whitened = ((returns - mean) * rstd).split(lengths)
    assert all(bool((row == row[0]).all()) for row in whitened)  # one value per row: the row's advantage
    return torch.stack([row[0] for row in whitened])


def test_reinforce_pp_whitens_over_the_loss_tokens_of_a_ragged_batch_as_openrlhf_does():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    lengths = [9, 1, 4, 2, 7]
    expected = openrlhf_whitened(rewards, lengths)
    advantages = reinforce_pp_advantages(rewards, torch.arange(5), torch.tensor(lengths))
    torch.testing.assert_close(advantages, expected, rtol=1e-12, atol=1e-12)
    by_rows = reinforce_pp_advantages(rewards, torch.arange(5), torch.tensor(lengths), whiten="rows")
    assert float((advantages - by_rows).abs().max()) > 0.1  # on ragged rows the two differ, a lot
    # the docstring's example
    torch.testing.assert_close(reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.arange(2), torch.tensor([3, 1])),
                               torch.tensor([1 / math.sqrt(3), -math.sqrt(3)]), rtol=1e-6, atol=0)


def test_reinforce_pp_rows_option_whitens_each_row_once():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # mean 0.25, sample std 0.5
    advantages = reinforce_pp_advantages(rewards, torch.arange(4), torch.tensor([5, 1, 1, 9]), whiten="rows")
    torch.testing.assert_close(advantages, torch.tensor([1.5, -0.5, -0.5, -0.5], dtype=torch.float64),
                               rtol=1e-5, atol=0)
    # equal lengths: tokens and rows agree up to the variance's Bessel correction and epsilon
    equal = reinforce_pp_advantages(rewards, torch.arange(4), torch.tensor([3, 3, 3, 3]))
    torch.testing.assert_close(equal, advantages * math.sqrt(4 / 3), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="token_counts"):
        reinforce_pp_advantages(rewards, torch.arange(4))
    with pytest.raises(ValueError, match="whiten='columns'"):
        reinforce_pp_advantages(rewards, torch.arange(4), torch.ones(4), whiten="columns")


def test_reinforce_pp_baseline_centers_per_group_then_whitens_globally():
    rewards = torch.tensor([1.0, 0.0, 5.0, 6.0], dtype=torch.float64)
    lengths = [2, 6, 3, 1]
    centered = torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=torch.float64)  # group-centred rewards
    advantages = reinforce_pp_baseline_advantages(rewards, torch.tensor([0, 0, 1, 1]), torch.tensor(lengths))
    torch.testing.assert_close(advantages, openrlhf_whitened(centered, lengths), rtol=1e-12, atol=1e-12)
    rows = reinforce_pp_baseline_advantages(rewards, torch.tensor([0, 0, 1, 1]), torch.tensor(lengths), whiten="rows")
    torch.testing.assert_close(rows, centered * math.sqrt(3), rtol=1e-5, atol=0)  # mean 0, sample std sqrt(1/3)


@pytest.mark.parametrize("estimator", [grpo_advantages, drgrpo_advantages, rloo_advantages])
def test_group_advantages_sum_to_zero_per_group(estimator):
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(12, generator=g, dtype=torch.float64)
    groups = torch.arange(12) % 3
    advantages = estimator(rewards, groups)
    for gid in range(3):
        assert abs(float(advantages[groups == gid].sum())) < 1e-12


@pytest.mark.parametrize("rewards,groups", [
    (torch.tensor([[1.0]]), torch.tensor([[0]])),
    (torch.tensor([1.0, float("nan")]), torch.tensor([0, 0])),
    (torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0])),
    (torch.tensor([1.0, 0.0]), torch.tensor([0, 0, 1])),
])
def test_bad_inputs_raise_value_error(rewards, groups):
    with pytest.raises(ValueError):
        grpo_advantages(rewards, groups)


# ---- FlashREINFORCE's baseline in a mixture of tasks (algo.options.baseline) ---------------------------------

def test_the_task_baseline_centres_each_task_on_its_own_mean_and_the_batch_baseline_on_the_batchs():
    from flashreinforce.algorithms.advantages import flashreinforce_advantages, single_row_tasks

    rewards, groups = torch.tensor([1.0, 0.0, 10.0, 20.0]), torch.arange(4)
    tasks = torch.tensor([0, 0, 1, 1])
    assert torch.allclose(flashreinforce_advantages(rewards, groups), torch.tensor([-6.75, -7.75, 2.25, 12.25]))
    by_task = flashreinforce_advantages(rewards, groups, baseline="task", task_ids=tasks)
    assert torch.allclose(by_task, torch.tensor([0.5, -0.5, -5.0, 5.0]))
    # each task's advantages sum to zero: a task of larger rewards no longer pushes the other's rows down
    assert all(abs(float(by_task[tasks == t].sum())) < 1e-6 for t in (0, 1))
    one_task = torch.zeros(4, dtype=torch.long)
    assert torch.equal(flashreinforce_advantages(rewards, groups, baseline="task", task_ids=one_task),
                       flashreinforce_advantages(rewards, groups))
    alone = torch.tensor([0, 0, 1, 2])  # tasks 1 and 2 have one row each: advantage 0, counted
    assert flashreinforce_advantages(rewards, groups, baseline="task", task_ids=alone)[2:].tolist() == [0.0, 0.0]
    assert single_row_tasks(alone) == 2
    with pytest.raises(ValueError, match="baseline='prompt' is not one of"):
        flashreinforce_advantages(rewards, groups, baseline="prompt")


def test_the_baseline_is_an_option_of_the_flashreinforce_loss_and_validated():
    from flashreinforce.algorithms import LOSSES

    spec = LOSSES["flashreinforce"]
    assert spec.advantage_defaults == {"baseline": "batch"}
    advantage, objective = spec.split_options({"baseline": "task", "delta": 1e-3}, "flashreinforce")
    assert (advantage, objective) == ({"baseline": "task"}, {"delta": 1e-3})
    with pytest.raises(ValueError, match="option baseline='row' is not one of"):
        spec.split_options({"baseline": "row"}, "flashreinforce")


# ---- REINFORCE++ in a mixture of tasks: whitening per task (algo.options.baseline=task) ----------------------

@pytest.mark.parametrize("name", ["reinforce++", "reinforce++-baseline"])
@pytest.mark.parametrize("whiten", ["tokens", "rows"])
def test_reinforce_pp_task_baseline_whitens_each_task_alone_so_scales_do_not_leak(name, whiten):
    from flashreinforce.algorithms import LOSSES

    estimator = LOSSES[name].advantages
    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(12, generator=g, dtype=torch.float64).round()  # pass/fail rewards
    groups, counts = torch.arange(12) // 2, torch.randint(1, 9, (12,), generator=g)
    tasks = (torch.arange(12) >= 6).long()  # rows 0-5 task 0, rows 6-11 task 1; groups never span tasks
    by_task = estimator(rewards, groups, counts, task_ids=tasks, whiten=whiten, baseline="task")
    for t in (0, 1):  # each task alone gives its rows' advantages
        rows = tasks == t
        alone = estimator(rewards[rows], groups[rows], counts[rows], whiten=whiten)
        torch.testing.assert_close(by_task[rows], alone, rtol=1e-12, atol=1e-12)
    # task 1's rewards on another scale (x10, +5) change none of task 0's advantages, nor task 1's own (up to the
    # 1e-6 added to a row-whitening std)
    shifted = torch.where(tasks == 1, 10 * rewards + 5, rewards)
    torch.testing.assert_close(estimator(shifted, groups, counts, task_ids=tasks, whiten=whiten, baseline="task"),
                               by_task, rtol=1e-5, atol=1e-5)
    # ... while whitening over the whole batch lets them move task 0's (the mixture's defect this option removes)
    batch = estimator(rewards, groups, counts, task_ids=tasks, whiten=whiten)
    moved = estimator(shifted, groups, counts, task_ids=tasks, whiten=whiten)
    assert float((batch[:6] - moved[:6]).abs().max()) > 0.1
    # one task: the same as the batch
    one = torch.zeros(12, dtype=torch.long)
    torch.testing.assert_close(estimator(rewards, groups, counts, task_ids=one, whiten=whiten, baseline="task"),
                               batch, rtol=0, atol=0)


def test_reinforce_pp_baseline_is_an_option_and_validated():
    from flashreinforce.algorithms import LOSSES

    spec = LOSSES["reinforce++"]
    assert spec.advantage_defaults == {"whiten": "tokens", "baseline": "batch"}
    with pytest.raises(ValueError, match="option baseline='group' is not one of"):
        spec.split_options({"baseline": "group"}, "reinforce++")
