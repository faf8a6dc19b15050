"""WPSM, the Well-learned Positive Sample Mask (ERNIE 5.0 eq. 4; ALGORITHMS.md 1.3), as per-row weights.

A response is "well-learned" when its prompt is already mostly solved (accuracy > tau) and the policy is
confident on it (mean token entropy < eta); its loss is scaled by 1 - alpha. The flags are computed once
per learner batch, at theta_old, before slicing, and reach the objectives as LossInputs.sequence_weights,
where they multiply each row's loss (they commute with MISC's token mask).

In a batch of several tasks every statistic a flag reads is the row's own task's: entropy is per row, accuracy
per prompt group (a group never spans tasks), and the advantage sign of positive_only comes from `within_tasks`,
since an advantage with a batch-wide baseline (FlashREINFORCE's batch mean, REINFORCE++'s whitening) would let
one task's rewards decide which of another task's rows count as positive.
"""

from __future__ import annotations

import torch
from torch import Tensor


def mean_token_entropy(entropies: Tensor, loss_mask: Tensor) -> Tensor:
    """H_{y_i}: mean full-vocabulary entropy over each row's loss tokens, detached.  (N, T) x2 -> (N,)"""
    if entropies.shape != loss_mask.shape or loss_mask.dtype != torch.bool:
        raise ValueError(f"entropies {tuple(entropies.shape)} and bool loss_mask {tuple(loss_mask.shape)} must "
                         "share one (N, T) shape")
    lengths = loss_mask.sum(-1)
    if bool((lengths == 0).any()):
        raise ValueError("every row needs at least one loss token to have a mean entropy")
    return torch.where(loss_mask, entropies.detach(), 0.0).sum(-1) / lengths


def wpsm_flags(
    mean_entropy: Tensor,
    accuracy: Tensor,
    advantages: Tensor,
    *,
    entropy_bound: float,
    accuracy_threshold: float,
    positive_only: bool = True,
) -> Tensor:
    """M_i = 1[H_i < eta and acc_i > tau (and A_i > 0 when positive_only)].   (N,) x3 -> (N,) bool

    Both inequalities are strict (ERNIE eq. 4): H == eta or acc == tau is not flagged. `accuracy` is the
    accuracy of each row's prompt: its current group (advantages.group_mean(passed.float(), group_ids))
    or a running per-prompt success rate; in a mixture, `advantages` are each row's within its task
    (within_tasks). positive_only (our default [R], from the method's name) keeps
    confident wrong answers' negative gradient: a row with A_i <= 0 is never flagged.
    Example: H [0.1, 0.1, 0.9], acc [0.9, 0.9, 0.9], A [1, -1, 1], eta 0.5, tau 0.8 -> [True, False, False].
    """
    if not (mean_entropy.shape == accuracy.shape == advantages.shape) or mean_entropy.ndim != 1:
        raise ValueError(f"mean_entropy {tuple(mean_entropy.shape)}, accuracy {tuple(accuracy.shape)} and advantages "
                         f"{tuple(advantages.shape)} must all be (N,)")
    flags = (mean_entropy < entropy_bound) & (accuracy > accuracy_threshold)
    return flags & (advantages > 0) if positive_only else flags


def wpsm_weights(flags: Tensor, mask_weight: float = 1.0) -> Tensor:
    """Sequence weights 1 - alpha * M_i: alpha = 1 drops flagged rows, alpha = 0 turns WPSM off.  (N,) -> (N,)

    alpha is the MASKED part, as the printed equation says (the prose could be read the other way).
    """
    if not 0 <= mask_weight <= 1:
        raise ValueError(f"wpsm mask_weight (alpha)={mask_weight} must be in [0, 1]")
    if flags.dtype != torch.bool:
        raise ValueError(f"flags must be bool, got {flags.dtype}")
    return 1.0 - mask_weight * flags.to(torch.float32)
