"""WPSM flags and weights (ALGORITHMS.md 1.3); their effect inside an objective is in test_objectives.py."""

import pytest
import torch

from flashreinforce.algorithms import (
    batch_mean_advantages,
    group_mean,
    grpo_advantages,
    mean_token_entropy,
    reinforce_pp_advantages,
    wpsm_flags,
    wpsm_weights,
)
from flashreinforce.algorithms.advantages import within_tasks


def test_mean_token_entropy_over_loss_tokens_only():
    entropies = torch.tensor([[1.0, 3.0, float("nan")], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert mean_token_entropy(entropies, mask).tolist() == [2.0, 2.0]


def test_eq4_flags_every_confident_response_of_a_well_learned_query_right_or_wrong():
    entropy, accuracy = torch.tensor([0.1, 0.1, 0.9, 0.1]), torch.tensor([0.9, 0.9, 0.9, 0.5])
    advantages = torch.tensor([1.0, -1.0, 1.0, 1.0])
    flags = wpsm_flags(entropy, accuracy, advantages, entropy_bound=0.5, accuracy_threshold=0.8)
    assert flags.tolist() == [True, True, False, False]  # the confident wrong answer (A < 0) too
    positive = wpsm_flags(entropy, accuracy, advantages, entropy_bound=0.5, accuracy_threshold=0.8, positive_only=True)
    assert positive.tolist() == [True, False, False, False]


def test_inequalities_are_strict():
    flags = wpsm_flags(torch.tensor([0.5, 0.1, 0.4999]), torch.tensor([0.9, 0.8, 0.9]), torch.ones(3),
                       entropy_bound=0.5, accuracy_threshold=0.8)
    assert flags.tolist() == [False, False, True]  # H == eta and acc == tau are not flagged


def test_a_group_at_or_below_tau_has_no_flagged_row():
    passed = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    accuracy = group_mean(passed, groups)  # group 0: 0.5, group 1: 1.0
    flags = wpsm_flags(torch.zeros(8), accuracy, passed - 0.5, entropy_bound=1.0, accuracy_threshold=0.5,
                       positive_only=True)
    assert flags.tolist() == [False] * 4 + [True] * 4


def test_positive_only_never_flags_zero_or_negative_advantages():
    entropy, accuracy = torch.zeros(3), torch.ones(3)
    advantages = torch.tensor([0.0, -0.3, 0.2])
    on = wpsm_flags(entropy, accuracy, advantages, entropy_bound=1.0, accuracy_threshold=0.5, positive_only=True)
    off = wpsm_flags(entropy, accuracy, advantages, entropy_bound=1.0, accuracy_threshold=0.5)
    assert on.tolist() == [False, False, True] and off.tolist() == [True, True, True]


def test_query_success_is_every_rollout_of_the_query_so_far_and_needs_min_rollouts():
    from flashreinforce.algorithms import QuerySuccess

    rates = QuerySuccess()
    rates.add(["a", "b"], [True, True])  # step 1, one rollout a prompt: one result each, no rate yet
    assert rates.rates(["a", "b", "c"], min_rollouts=2).tolist() == [float("-inf")] * 3
    assert rates.rates(["a"], min_rollouts=1).tolist() == [1.0]
    rates.add(["a", "b"], [True, False])  # step 2 (another epoch): a 2/2, b 1/2
    assert rates.rates(["a", "b"], min_rollouts=2).tolist() == [1.0, 0.5]
    restored = QuerySuccess()
    restored.load_state_dict(rates.state_dict())  # a checkpoint: the same rates, counted on exactly
    restored.add(["b"], [True])
    rates.add(["b"], [True])
    assert restored.state_dict() == rates.state_dict() == {"a": [2, 2], "b": [2, 3]}
    flags = wpsm_flags(torch.zeros(3), rates.rates(["a", "b", "c"], min_rollouts=2), torch.zeros(3),
                       entropy_bound=1.0, accuracy_threshold=0.6)
    assert flags.tolist() == [True, True, False]  # 1.0 > 0.6, 2/3 > 0.6; c was never seen
    with pytest.raises(ValueError, match="min_rollouts"):
        rates.rates(["a"], min_rollouts=0)


def test_weights_are_one_minus_alpha_on_flagged_rows():
    flags = torch.tensor([True, False])
    assert wpsm_weights(flags, 0.25).tolist() == [0.75, 1.0]
    assert wpsm_weights(flags).tolist() == [0.0, 1.0]  # default alpha = 1: a hard mask
    with pytest.raises(ValueError, match="alpha"):
        wpsm_weights(flags, 1.5)


# ---- several tasks in one batch: every statistic a flag reads is the row's own task's --------------------------

def _batch(seed, rows=24, tasks=2):
    """Random rows of groups of 3 (one task each), tasks interleaved, rewards of a different scale per task."""
    g = torch.Generator().manual_seed(seed)
    groups = torch.arange(rows) // 3
    task_ids = torch.randint(0, tasks, (rows // 3,), generator=g)[groups]
    passed = torch.randint(0, 2, (rows,), generator=g).float()
    rewards = passed + 10.0 * task_ids + torch.rand(rows, generator=g, dtype=torch.float64).float()
    entropy = torch.rand(rows, generator=g)
    counts = torch.randint(1, 9, (rows,), generator=g)
    return entropy, passed, rewards, groups, task_ids, counts


ESTIMATORS = {
    "batch_mean": lambda r, g, n: batch_mean_advantages(r, g),
    "reinforce_pp": lambda r, g, n: reinforce_pp_advantages(r, g, n),
    "grpo": lambda r, g, n: grpo_advantages(r, g),
}


def _wpsm(entropy, passed, rewards, groups, task_ids, counts, estimator):
    """WPSM as the trainer composes it with positive_only and the group rate: advantages within tasks, group
    accuracy, then the flags."""
    advantages = within_tasks(estimator, task_ids, rewards, groups, counts)
    flags = wpsm_flags(entropy, group_mean(passed, groups), advantages, entropy_bound=0.6, accuracy_threshold=0.3,
                       positive_only=True)
    return advantages, flags


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("seed", range(5))
def test_one_task_is_exactly_the_statistic_of_the_whole_batch(name, seed):
    _, _, rewards, groups, _, counts = _batch(seed)
    estimator = ESTIMATORS[name]
    for task_ids in (None, torch.zeros_like(groups), torch.full_like(groups, 3)):
        got = within_tasks(estimator, task_ids, rewards, groups, counts)
        assert torch.equal(got, estimator(rewards, groups, counts))


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("seed", range(5))
def test_with_two_tasks_each_tasks_advantages_and_flags_are_those_of_its_rows_alone(name, seed):
    entropy, passed, rewards, groups, task_ids, counts = _batch(seed)
    assert task_ids.unique().numel() == 2
    together = _wpsm(entropy, passed, rewards, groups, task_ids, counts, ESTIMATORS[name])
    for task in (0, 1):
        own = task_ids == task
        alone = _wpsm(*(x[own] for x in (entropy, passed, rewards, groups)), torch.zeros_like(groups[own]),
                      counts[own], ESTIMATORS[name])
        assert all(torch.equal(mixed[own], single) for mixed, single in zip(together, alone))


def test_the_batch_mean_would_let_one_tasks_rewards_decide_anothers_flags():
    """The property above fails without within_tasks: task 0's correct rows (reward 1) sit below a batch mean
    lifted by task 1's rewards of 10 and count as negative."""
    rewards, groups = torch.tensor([1.0, 0.0, 10.0, 11.0]), torch.tensor([0, 0, 1, 1])
    tasks = groups.clone()
    whole = batch_mean_advantages(rewards, groups)
    assert whole.tolist() == [-4.5, -5.5, 4.5, 5.5]
    assert within_tasks(batch_mean_advantages, tasks, rewards, groups).tolist() == [0.5, -0.5, -0.5, 0.5]
    flags = wpsm_flags(torch.zeros(4), torch.ones(4), within_tasks(batch_mean_advantages, tasks, rewards, groups),
                       entropy_bound=1.0, accuracy_threshold=0.5, positive_only=True)
    assert flags.tolist() == [True, False, False, True]


def test_within_tasks_refuses_rows_of_another_length():
    with pytest.raises(ValueError, match="first dimension"):
        within_tasks(batch_mean_advantages, torch.tensor([0, 1, 1]), torch.ones(4), torch.arange(4))
