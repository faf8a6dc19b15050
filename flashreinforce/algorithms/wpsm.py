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

from collections.abc import Callable

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


def within_tasks(statistic: Callable[..., Tensor], task_ids: Tensor | None, *rows: Tensor) -> Tensor:
    """statistic(*rows) computed on each task's rows alone, put back in row order.   (N,) ids, (N, ...) rows -> (N,)

    A single task (or task_ids None) is statistic(*rows) itself, so a one-task run is exactly as without tasks.
    Example: statistic = rewards - rewards.mean(), rewards [1, 0, 10, 20], task_ids [0, 0, 1, 1]
    -> [0.5, -0.5, -5, 5] (the whole batch would give [-6.75, -7.75, 2.25, 12.25]).
    """
    if task_ids is None:
        return statistic(*rows)
    if task_ids.ndim != 1 or task_ids.is_floating_point() or any(r.shape[:1] != task_ids.shape for r in rows):
        raise ValueError(f"integer task_ids {tuple(task_ids.shape)} and every row tensor "
                         f"{[tuple(r.shape) for r in rows]} must share their first dimension N")
    tasks = torch.unique(task_ids)
    if tasks.numel() <= 1:
        return statistic(*rows)
    indices = [(task_ids == task).nonzero().squeeze(1) for task in tasks]
    values = [statistic(*(r[index] for r in rows)) for index in indices]
    out = values[0].new_empty(task_ids.shape + values[0].shape[1:])
    for index, value in zip(indices, values):
        out[index] = value
    return out


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
