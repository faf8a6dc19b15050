"""Policy-drift surrogates: PPO-clip per token (GRPO, DAPO, ...) and GSPO's sequence ratio.

Pure functions of the live-vs-old log-ratio log r = log pi_theta - log pi_old (with gradient) and the
advantages. Sign convention: these return the surrogate to MAXIMISE; objectives negate it. Nothing here
knows about train/inference mismatch (mismatch.py) or normalisation (aggregation.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashreinforce.algorithms.aggregation import masked_row_mean

Epsilon = float | Tensor
"""A clip range: one float, or a (b, 1) tensor of per-row ranges (MISC per-modality trust regions)."""


def ppo_clip(ratio: Tensor, advantages: Tensor, eps_low: Epsilon, eps_high: Epsilon) -> tuple[Tensor, Tensor]:
    """min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) and where that clip removes the gradient.

    Asymmetric clip as in DAPO ("clip-higher", eps_high > eps_low). The clip bites, and the gradient is 0,
    exactly when r > 1 + eps_high with A > 0, or r < 1 - eps_low with A < 0; otherwise the surrogate is
    r A. Example: r = 1.5, A = 2, eps 0.2 -> surrogate 2.4, clipped; r = 1.5, A = -2 -> -3, not clipped.
    Shapes broadcast: ratio (b, T) or (b,), advantages alike or (b, 1). Returns (surrogate, clipped bool).
    """
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - eps_low, 1 + eps_high) * advantages)
    clipped = ((advantages > 0) & (ratio > 1 + eps_high)) | ((advantages < 0) & (ratio < 1 - eps_low))
    return surrogate, clipped


def gspo_log_ratio(log_ratio: Tensor, loss_mask: Tensor) -> Tensor:
    """log s_i = (1/|y_i|) sum_j log r_ij: GSPO's length-normalised sequence log-ratio.  (b, T) -> (b,)

    Kept in log space: s_i = exp(log s_i) > 0 for any length, and a constant per-token ratio r gives
    s_i = r whatever |y_i| is.
    """
    return masked_row_mean(log_ratio, loss_mask)


def gspo_token_ratio(log_ratio: Tensor, loss_mask: Tensor) -> Tensor:
    """GSPO-token: s_ij = sg[s_i] * pi_theta(y_ij) / sg[pi_theta(y_ij)].   (b, T) -> (b, T)

    Its value is s_i at every token, and d s_ij / d log pi_theta(y_ij) = s_i, so with a per-sequence
    advantage it is GSPO in value, clipping and gradient while allowing per-token advantages and masks.
    """
    sequence = gspo_log_ratio(log_ratio, loss_mask).detach().exp()[:, None]  # (b, 1)
    return sequence * (log_ratio - log_ratio.detach()).exp()
