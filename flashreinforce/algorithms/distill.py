"""On-policy distillation's per-token signal (ALGORITHMS.md 8c): how far a frozen teacher rates the student's own
tokens above or below the student.

The student samples y ~ mu (the engine), the trainer recomputes log pi_S at theta_old, and a teacher scores the same
tokens. The signal of token j of row i is

    a_ij = sg[log pi_T(y_ij | x, y_i<j) - log pi_S(y_ij | x, y_i<j)]

used as that token's advantage: a policy gradient on it descends KL(pi_S || pi_T) on the student's own
distribution (reverse KL: mode-seeking, the student is not asked to cover what it never samples). Its sum over a
row is minus the sampled (k1) estimate of the sequence's reverse KL. The student's log-probs are the trainer's at
theta_old, not the sampler's: with the mismatch weights on rho = pi_old / mu the update is then one of
KL(pi_S_train || pi_T), and the sampler's numerics never enter the signal. Nothing here knows about ratios,
clipping or normalisation (objectives.py).
"""

from __future__ import annotations

import torch
from torch import Tensor


def teacher_signal(teacher_logprobs: Tensor, student_logprobs: Tensor, loss_mask: Tensor,
                   clip: float | None = None) -> Tensor:
    """a_ij = log pi_T - log pi_S on the loss mask, clipped to [-clip, clip] when given; 0 elsewhere; detached.
    (b, T) x2, (b, T) bool -> (b, T)

    Example: teacher [-0.1, -3.0], student [-1.0, -0.5] -> [0.9, -2.5]; with clip 1.0 -> [0.9, -1.0].
    """
    teacher = torch.where(loss_mask, teacher_logprobs.detach(), 0.0)  # where() first: NaN off the mask stays out
    gap = teacher - torch.where(loss_mask, student_logprobs.detach(), 0.0)
    return gap if clip is None else gap.clamp(-clip, clip)


def sequence_reverse_kl(teacher_logprobs: Tensor, student_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """Each row's sampled estimate of KL(pi_S || pi_T) over its loss tokens: sum_j (log pi_S - log pi_T), the
    unclipped minus-signal summed.   (b, T) x2, (b, T) bool -> (b,)

    Unbiased for the sequence-level reverse KL when the row was sampled from pi_S; a single row's may be negative.
    """
    return -teacher_signal(teacher_logprobs, student_logprobs, loss_mask).sum(-1)
