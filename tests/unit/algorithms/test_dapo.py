"""DAPO overlong shaping and the dynamic-sampling filter (ALGORITHMS.md section 7, property 2)."""

import pytest
import torch

from flashreinforce.algorithms import dynamic_sampling_keep, grpo_advantages, overlong_penalty


def test_overlong_penalty_hand_values():
    penalty = overlong_penalty(torch.tensor([0, 6, 7, 8, 10, 11]), max_length=10, cache_length=4)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])


def test_overlong_penalty_is_continuous_at_the_soft_limit_and_minus_one_at_the_limit():
    soft, limit = 20480 - 4096, 20480
    penalty = overlong_penalty(torch.tensor([soft, soft + 1, limit, limit + 1]))
    assert penalty[0] == 0 and -1e-3 < penalty[1] < 0
    assert penalty[2] == -1 and penalty[3] == -1


def test_overlong_penalty_rejects_bad_settings():
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), max_length=10, cache_length=11)


def test_dynamic_sampling_keeps_groups_with_mixed_rewards():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([4, 4, 9, 9, 2, 2, 9])
    assert dynamic_sampling_keep(rewards, groups).tolist() == [False, False, True, True, False, False, True]


def test_a_dynamic_sampling_batch_has_no_zero_std_group():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (64,), generator=g).float()
    groups = torch.arange(64) // 4
    keep = dynamic_sampling_keep(rewards, groups)
    assert 0 < keep.sum() < 64
    kept_rewards, kept_groups = rewards[keep], groups[keep]
    for gid in kept_groups.unique():
        assert kept_rewards[kept_groups == gid].std() > 0
    assert grpo_advantages(kept_rewards, kept_groups).ne(0).all()
