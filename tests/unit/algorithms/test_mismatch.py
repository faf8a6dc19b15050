"""Mismatch weights: TIS / MIS / IcePop / geometric RS properties (ALGORITHMS.md 3, 5.1, 5.2)."""

import math

import pytest
import torch

from flashreinforce.algorithms.mismatch import (
    geo_rs_weights,
    icepop_weights,
    log_ratio,
    mis_weights,
    mismatch_weights,
    seq_icepop_weights,
    seq_mis_weights,
    seq_tis_weights,
    tis_weights,
)

MASK = torch.tensor([[True, True, True, False]])


def logs(*rhos):
    return torch.tensor([[math.log(r) for r in rhos] + [0.0]], dtype=torch.float64)


@pytest.mark.parametrize("mode", ["tis", "seq_tis", "mis", "seq_mis", "icepop", "seq_icepop", "geo_rs"])
def test_no_mismatch_gives_unit_weights(mode):
    weights = mismatch_weights(mode, torch.zeros(1, 4, dtype=torch.float64), MASK, cap=2.0,
                               icepop_band=(0.5, 5.0), icepop_weight="ratio", geo_rs_band=(0.999, 1.001))
    assert weights.tolist() == [[1.0, 1.0, 1.0, 0.0]]


def test_tis_is_truncated_and_continuous():
    assert tis_weights(logs(0.5, 2.0, 3.0), MASK, cap=2.0)[0].tolist() == pytest.approx([0.5, 2.0, 2.0, 0.0])


def test_mis_is_discontinuous_at_the_cap():
    cap = math.exp(math.log(2.0))  # the value exp() gives back, so rho == cap exactly
    weights = mis_weights(logs(0.5, 2.0, 2.0 + 1e-9), MASK, cap=cap)
    assert weights[0].tolist() == pytest.approx([0.5, 2.0, 0.0, 0.0])


def test_seq_tis_truncates_the_product():
    # prod = 0.5 * 3 * 1 = 1.5 < 2; prod = 4 * 3 * 1 = 12 -> 2
    assert seq_tis_weights(logs(0.5, 3.0, 1.0), MASK, cap=2.0)[0].tolist() == pytest.approx([1.5, 1.5, 1.5, 0.0])
    assert seq_tis_weights(logs(4.0, 3.0, 1.0), MASK, cap=2.0)[0].tolist() == pytest.approx([2.0, 2.0, 2.0, 0.0])


def test_seq_mis_zeros_a_row_iff_its_log_ratio_sum_exceeds_log_cap():
    g = torch.Generator().manual_seed(0)
    log_rho = torch.randn(64, 4, generator=g, dtype=torch.float64) * 0.4
    mask = torch.ones(64, 4, dtype=torch.bool)
    weights = seq_mis_weights(log_rho, mask, cap=1.5)
    over = log_rho.sum(-1) > math.log(1.5)
    assert 0 < over.sum() < 64
    assert weights[over].eq(0).all()
    torch.testing.assert_close(weights[~over], log_rho.sum(-1).exp()[~over][:, None].expand(-1, 4))


def test_icepop_band_is_inclusive_and_weights_by_rho():
    low, high = math.exp(math.log(0.5)), math.exp(math.log(5.0))
    weights = icepop_weights(logs(0.5, 5.0, 0.49), MASK, low, high)
    assert weights[0].tolist() == pytest.approx([0.5, 5.0, 0.0, 0.0])
    binary = icepop_weights(logs(0.5, 5.0, 5.01), MASK, low, high, "binary")
    assert binary.tolist() == [[1.0, 1.0, 0.0, 0.0]]


def test_seq_icepop_uses_the_geometric_mean():
    # geometric mean of (0.25, 1, 4) is 1 -> in band, weight 1; of (0.25, 0.25, 1) is 0.397 -> out
    assert seq_icepop_weights(logs(0.25, 1.0, 4.0), MASK, 0.5, 5.0)[0].tolist() == pytest.approx([1, 1, 1, 0])
    assert seq_icepop_weights(logs(0.25, 0.25, 1.0), MASK, 0.5, 5.0).tolist() == [[0, 0, 0, 0]]


def test_geo_rs_keeps_or_drops_whole_rows_with_weight_one():
    assert geo_rs_weights(logs(1.0005, 0.9995, 1.0), MASK, 0.999, 1.001).tolist() == [[1, 1, 1, 0]]
    assert geo_rs_weights(logs(1.01, 1.0, 1.0), MASK, 0.999, 1.001).tolist() == [[0, 0, 0, 0]]


def test_log_ratio_is_guarded_and_ignores_masked_garbage():
    numerator = torch.tensor([[0.0, -100.0, float("nan")]])
    denominator = torch.tensor([[-50.0, -1.0, float("inf")]])
    mask = torch.tensor([[True, True, False]])
    assert log_ratio(numerator, denominator, mask).tolist() == [[30.0, -30.0, 0.0]]


def test_weights_carry_no_gradient():
    log_rho = torch.tensor([[0.1, -0.2, 0.0, 0.0]], requires_grad=True)
    for mode in ("tis", "seq_tis", "mis", "seq_mis", "icepop", "seq_icepop", "geo_rs"):
        weights = mismatch_weights(mode, log_rho, MASK, cap=2.0, icepop_band=(0.5, 5.0), icepop_weight="ratio",
                                   geo_rs_band=(0.5, 2.0))
        assert not weights.requires_grad, mode


def test_unknown_mode_raises():
    with pytest.raises(ValueError, match="mismatch"):
        mismatch_weights("clip", logs(1, 1, 1), MASK, cap=2.0, icepop_band=(0.5, 5.0), icepop_weight="ratio",
                         geo_rs_band=(0.9, 1.1))
