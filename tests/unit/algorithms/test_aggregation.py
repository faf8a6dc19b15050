"""Aggregation modes: the docstring example and Dr.GRPO's length independence."""

import pytest
import torch

from flashreinforce.algorithms.aggregation import aggregate

LOSS = torch.tensor([[1.0, 3.0], [2.0, float("nan")]])
MASK = torch.tensor([[True, True], [True, False]])
NORM = dict(num_sequences=2, num_tokens=3, max_new_tokens=4)


@pytest.mark.parametrize("mode,expected", [("token-mean", 2.0), ("seq-mean-token-mean", 2.0),
                                           ("seq-mean-token-sum-norm", 0.75)])
def test_hand_values_ignore_masked_slots(mode, expected):
    assert aggregate(LOSS, MASK, mode, **NORM).item() == pytest.approx(expected)


def test_global_denominators_not_the_slice_ones():
    # one row of a batch of 4 rows / 10 tokens: its share, not its own mean
    loss = torch.tensor([[2.0, 4.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    norm = dict(num_sequences=4, num_tokens=10, max_new_tokens=8)
    assert aggregate(loss, mask, "token-mean", **norm).item() == pytest.approx(0.6)
    assert aggregate(loss, mask, "seq-mean-token-mean", **norm).item() == pytest.approx(0.75)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", **norm).item() == pytest.approx(6 / 8 / 4)


def test_seq_mean_token_sum_norm_token_weight_does_not_depend_on_length():
    for length in (1, 3, 6):
        per_token = torch.zeros(1, 6, requires_grad=True)
        mask = torch.arange(6)[None, :] < length
        aggregate(per_token, mask, "seq-mean-token-sum-norm", num_sequences=2, num_tokens=9,
                  max_new_tokens=8).backward()
        assert per_token.grad[mask].eq(1 / 16).all()


def test_unknown_mode_raises():
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(LOSS, MASK, "sum", **NORM)
