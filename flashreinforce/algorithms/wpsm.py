"""WPSM, the Well-learned Positive Sample Mask (ERNIE 5.0 eq. 4), as per-row weights.

A response is "well-learned" when its query is already mostly solved (its success rate acc_x^t > tau) and the
policy is confident on it (mean token entropy < eta); its loss is scaled by 1 - alpha. Eq. 4 flags every such
response, right or wrong. acc_x^t is each query's success rate kept over training (QuerySuccess: every rollout of
the query trained so far, over steps, epochs and stages, the current step's included), which works with one
rollout per prompt, where the current group's rate would be the row's own result. The current group's accuracy
and flagging only positive rows (positive_only) remain as options: both depart from eq. 4. The flags are computed
once per learner batch, at theta_old, and reach the objectives as LossInputs.sequence_weights, where they multiply
each row's loss (they commute with MISC's token mask).

In a batch of several tasks every statistic a flag reads is the row's own task's: entropy is per row, accuracy
per query (or prompt group, which never spans tasks), and the advantage sign of positive_only comes from
`within_tasks`, since an advantage with a batch-wide baseline (FlashREINFORCE's batch mean, REINFORCE++'s
whitening) would let one task's rewards decide which of another task's rows count as positive.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


class QuerySuccess:
    """Each query's success rate over every rollout of it trained so far: ERNIE eq. 4's acc_x^t.

    >>> rates = QuerySuccess()
    >>> rates.add(["q1", "q1", "q2"], [True, False, True])
    >>> rates.rates(["q1", "q2"], min_rollouts=2)   # q2 has one rollout: no rate yet (-inf, never > tau)
    tensor([0.5000, -inf])

    Plain counts, so the state is exact and small (two ints a query) and a resumed run holds the same rates.
    """

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}  # query id -> [successes, rollouts]

    def add(self, query_ids: Sequence[str], passed: Sequence[bool]) -> None:
        if len(query_ids) != len(passed):
            raise ValueError(f"{len(query_ids)} query ids for {len(passed)} results")
        for query, success in zip(query_ids, passed):
            count = self.counts.setdefault(query, [0, 0])
            count[0] += bool(success)
            count[1] += 1

    def rates(self, query_ids: Sequence[str], *, min_rollouts: int) -> Tensor:
        """(N,) each query's rate, -inf where fewer than `min_rollouts` of its rollouts were counted (one result
        is not a rate: with one rollout a prompt, the row's own)."""
        if min_rollouts < 1:
            raise ValueError(f"min_rollouts={min_rollouts} must be >= 1")
        out = []
        for query in query_ids:
            successes, rollouts = self.counts.get(query, (0, 0))
            out.append(successes / rollouts if rollouts >= min_rollouts else -math.inf)
        return torch.tensor(out, dtype=torch.float32)

    def state_dict(self) -> dict[str, list[int]]:
        return {query: list(count) for query, count in self.counts.items()}

    def load_state_dict(self, state: Mapping[str, Sequence[int]]) -> None:
        self.counts = {query: [int(count[0]), int(count[1])] for query, count in state.items()}


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
    positive_only: bool = False,
) -> Tensor:
    """M_i = 1[H_i < eta and acc_i > tau (and A_i > 0 when positive_only)].   (N,) x3 -> (N,) bool

    Both inequalities are strict (ERNIE eq. 4): H == eta or acc == tau is not flagged. `accuracy` is the success
    rate of each row's query (QuerySuccess.rates; -inf: none yet, never flagged) or of its current group
    (advantages.group_mean(passed.float(), group_ids)); in a mixture, `advantages` are each row's within its task
    (within_tasks). Eq. 4 flags right and wrong answers alike; positive_only (a departure, from the method's name)
    keeps confident wrong answers' negative gradient: a row with A_i <= 0 is never flagged.
    Example: H [0.1, 0.1, 0.9], acc [0.9, 0.9, 0.9], A [1, -1, 1], eta 0.5, tau 0.8 -> [True, True, False]
    (positive_only: [True, False, False]).
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
