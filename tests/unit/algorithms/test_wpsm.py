"""WPSM flags and weights (ALGORITHMS.md 1.3); their effect inside an objective is in test_objectives.py."""

import pytest
import torch

from flashreinforce.algorithms import group_mean, mean_token_entropy, wpsm_flags, wpsm_weights


def test_mean_token_entropy_over_loss_tokens_only():
    entropies = torch.tensor([[1.0, 3.0, float("nan")], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert mean_token_entropy(entropies, mask).tolist() == [2.0, 2.0]


def test_flags_need_low_entropy_high_accuracy_and_positive_advantage():
    flags = wpsm_flags(torch.tensor([0.1, 0.1, 0.9, 0.1]), torch.tensor([0.9, 0.9, 0.9, 0.5]),
                       torch.tensor([1.0, -1.0, 1.0, 1.0]), entropy_bound=0.5, accuracy_threshold=0.8)
    assert flags.tolist() == [True, False, False, False]


def test_inequalities_are_strict():
    flags = wpsm_flags(torch.tensor([0.5, 0.1, 0.4999]), torch.tensor([0.9, 0.8, 0.9]), torch.ones(3),
                       entropy_bound=0.5, accuracy_threshold=0.8)
    assert flags.tolist() == [False, False, True]  # H == eta and acc == tau are not flagged


def test_a_group_at_or_below_tau_has_no_flagged_row():
    passed = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    accuracy = group_mean(passed, groups)  # group 0: 0.5, group 1: 1.0
    flags = wpsm_flags(torch.zeros(8), accuracy, passed - 0.5, entropy_bound=1.0, accuracy_threshold=0.5)
    assert flags.tolist() == [False] * 4 + [True] * 4


def test_positive_only_never_flags_zero_or_negative_advantages():
    entropy, accuracy = torch.zeros(3), torch.ones(3)
    advantages = torch.tensor([0.0, -0.3, 0.2])
    on = wpsm_flags(entropy, accuracy, advantages, entropy_bound=1.0, accuracy_threshold=0.5)
    off = wpsm_flags(entropy, accuracy, advantages, entropy_bound=1.0, accuracy_threshold=0.5, positive_only=False)
    assert on.tolist() == [False, False, True] and off.tolist() == [True, True, True]


def test_weights_are_one_minus_alpha_on_flagged_rows():
    flags = torch.tensor([True, False])
    assert wpsm_weights(flags, 0.25).tolist() == [0.75, 1.0]
    assert wpsm_weights(flags).tolist() == [0.0, 1.0]  # default alpha = 1: a hard mask
    with pytest.raises(ValueError, match="alpha"):
        wpsm_weights(flags, 1.5)
