"""Train/inference mismatch corrections: detached weights from rho = pi_old / mu (ALGORITHMS.md 1.2, 3, 5).

The inference engine samples from mu, the trainer recomputes pi_old at the same weights; kernels,
precision and stale partial rollouts make them differ. Every function here maps the per-token log-ratio
log rho = log pi_old - log mu (b, T) to a (b, T) weight that multiplies the per-token surrogate. Weights
carry no gradient and are 0 outside the loss mask. Sequence-level weights are broadcast to every token
of the row. Log-ratios are guarded to [-30, 30] (as Molt does) so no ratio overflows.

    mode        weight                                   source
    tis         min(rho_ij, C)                           TIS, token (Yao et al. 2025)
    seq_tis     min(prod_j rho_ij, C)                    TIS, sequence
    mis         rho_ij 1[rho_ij <= C]                    MIS, token (one-sided IcePop)
    seq_mis     rho_i 1[rho_i <= C], rho_i = prod rho    MIS, sequence
    icepop      rho_ij 1[a <= rho_ij <= b] (or binary)   IcePop (Ring-1T), ERNIE eq. 1
    seq_icepop  g_i 1[a <= g_i <= b] (or binary)         IcePop on GSPO, ERNIE eq. 2; g_i = geometric mean rho
    geo_rs      1[lo <= g_i <= hi]                       geometric rejection sampling (verl)
All bounds are inclusive.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flashreinforce.algorithms.aggregation import masked_row_mean

LOG_RATIO_GUARD = 30.0
"""|log ratio| is clamped to this before exponentiating (exp(30) ~ 1e13, far from fp32 overflow)."""

MISMATCH_MODES = ("none", "tis", "seq_tis", "mis", "seq_mis", "icepop", "seq_icepop", "geo_rs")
ICEPOP_WEIGHTS = ("ratio", "binary")
"""ratio: an in-band token is weighted by rho (IcePop, slime); binary: by 1 (verl token rejection)."""

Bound = float | Tensor
"""A band edge: one float, or a (b, 1) tensor of per-row edges (MISC per-modality bands)."""


def log_ratio(numerator: Tensor, denominator: Tensor, mask: Tensor) -> Tensor:
    """clamp(numerator - denominator, -30, 30) on mask, 0 elsewhere.   (b, T) x2, (b, T) bool -> (b, T)

    Differentiable in both inputs; callers detach what must not carry gradient. Inputs must already be
    finite on the mask (NaN elsewhere is fine: where() drops it before the subtraction reaches autograd).
    """
    difference = torch.where(mask, numerator, 0.0) - torch.where(mask, denominator, 0.0)
    return difference.clamp(-LOG_RATIO_GUARD, LOG_RATIO_GUARD)


def tis_weights(log_rho: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Token TIS: w_ij = min(rho_ij, C), continuous in rho."""
    return _on_mask(log_rho.detach().exp().clamp(max=cap), mask)


def seq_tis_weights(log_rho: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Sequence TIS: w_i = min(prod_j rho_ij, C) over the row's loss tokens, broadcast to them."""
    sequence = _row_sum(log_rho, mask).clamp(-LOG_RATIO_GUARD, LOG_RATIO_GUARD).exp().clamp(max=cap)  # (b,)
    return _on_mask(sequence[:, None].expand_as(log_rho), mask)


def mis_weights(log_rho: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Token MIS: w_ij = rho_ij if rho_ij <= C else 0, so w(C) = C but w(C + d) = 0."""
    rho = log_rho.detach().exp()
    return _on_mask(torch.where(rho <= cap, rho, 0.0), mask)


def seq_mis_weights(log_rho: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Sequence MIS: the whole row weighted by rho_i = prod_j rho_ij if sum_j log rho_ij <= log C, else 0."""
    log_sequence = _row_sum(log_rho, mask)  # (b,) decided in log space: the product itself may overflow
    guarded = log_sequence.clamp(-LOG_RATIO_GUARD, LOG_RATIO_GUARD)
    weight = torch.where(log_sequence <= math.log(cap), guarded.exp(), 0.0)
    return _on_mask(weight[:, None].expand_as(log_rho), mask)


def icepop_weights(log_rho: Tensor, mask: Tensor, low: Bound, high: Bound, weight: str = "ratio") -> Tensor:
    """IcePop: w_ij = rho_ij (or 1 when weight="binary") if low <= rho_ij <= high, else 0."""
    rho = log_rho.detach().exp()  # (b, T)
    return _on_mask(_band(rho, low, high, weight), mask)


def seq_icepop_weights(log_rho: Tensor, mask: Tensor, low: Bound, high: Bound, weight: str = "ratio") -> Tensor:
    """IcePop on GSPO (ERNIE eq. 2): the length-normalised g_i = exp(mean_j log rho_ij) against the band."""
    geometric = masked_row_mean(log_rho.detach(), mask).exp()[:, None]  # (b, 1)
    return _on_mask(_band(geometric, low, high, weight).expand_as(log_rho), mask)


def geo_rs_weights(log_rho: Tensor, mask: Tensor, low: float, high: float) -> Tensor:
    """Geometric rejection sampling: keep the whole row (weight 1) iff low <= g_i <= high, else 0."""
    return seq_icepop_weights(log_rho, mask, low, high, "binary")


def mismatch_weights(
    mode: str,
    log_rho: Tensor,
    mask: Tensor,
    *,
    cap: float,
    icepop_band: tuple[Bound, Bound],
    icepop_weight: str,
    geo_rs_band: tuple[float, float],
    seq_icepop_band: tuple[float, float] | None = None,
) -> Tensor:
    """The (b, T) weights of one MISMATCH_MODES entry; "none" gives the loss mask as 0/1 weights. seq_icepop judges
    `seq_icepop_band` (a geometric mean over a row lies far closer to 1 than its tokens' ratios; None: the token
    band)."""
    if mode == "none":
        return mask.to(log_rho.dtype)
    if mode == "tis":
        return tis_weights(log_rho, mask, cap)
    if mode == "seq_tis":
        return seq_tis_weights(log_rho, mask, cap)
    if mode == "mis":
        return mis_weights(log_rho, mask, cap)
    if mode == "seq_mis":
        return seq_mis_weights(log_rho, mask, cap)
    if mode == "icepop":
        return icepop_weights(log_rho, mask, *icepop_band, icepop_weight)
    if mode == "seq_icepop":
        return seq_icepop_weights(log_rho, mask, *(seq_icepop_band or icepop_band), icepop_weight)
    if mode == "geo_rs":
        return geo_rs_weights(log_rho, mask, *geo_rs_band)
    raise ValueError(f"mismatch={mode!r} is not one of {MISMATCH_MODES}")


def _band(rho: Tensor, low: Bound, high: Bound, weight: str) -> Tensor:
    inside = (rho >= low) & (rho <= high)  # inclusive, as slime's >= and <=
    if weight == "ratio":
        return torch.where(inside, rho, 0.0)
    if weight == "binary":
        return inside.to(rho.dtype)
    raise ValueError(f"icepop_weight={weight!r} is not one of {ICEPOP_WEIGHTS}")


def _row_sum(log_rho: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, log_rho.detach(), 0.0).sum(-1)  # (b,)


def _on_mask(weights: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, weights, 0.0)
