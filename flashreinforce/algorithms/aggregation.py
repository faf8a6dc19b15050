"""How per-token losses become one number, normalised by the WHOLE learner batch.

Every mode divides by global constants (B, the batch's loss-token count, the generation budget L) and by
each row's own T_i, never by a statistic of the slice at hand. So a microbatch's loss is already its
share of the full-batch loss: summing the slices' losses (and gradients) gives the full batch's. A row is
never split across slices, so T_i is always local.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""token-mean (DAPO), seq-mean-token-mean (GRPO, GSPO, FlashREINFORCE), seq-mean-token-sum-norm (Dr.GRPO)."""


def aggregate(
    token_loss: Tensor,
    loss_mask: Tensor,
    mode: str,
    *,
    num_sequences: int,
    num_tokens: int,
    max_new_tokens: int,
) -> Tensor:
    """Reduce a (b, T) per-token loss of one slice to its share of the batch loss (a scalar).

        token-mean:              sum_i sum_t l_it / N_tokens        (N_tokens = loss tokens of the batch)
        seq-mean-token-mean:     sum_i (1/T_i) sum_t l_it / B       (T_i = loss tokens of row i)
        seq-mean-token-sum-norm: sum_i (1/L)   sum_t l_it / B       (L = constant, the generation budget)

    Slots outside loss_mask are ignored, whatever they hold. Example: l = [[1, 3], [2, 0]], mask
    [[1, 1], [1, 0]], B=2, N_tokens=3, L=4: token-mean 2, seq-mean-token-mean (2 + 2)/2 = 2,
    seq-mean-token-sum-norm (4/4 + 2/4)/2 = 0.75.
    """
    token_loss = torch.where(loss_mask, token_loss, 0.0)  # (b, T)
    if mode == "token-mean":
        return token_loss.sum() / num_tokens
    if mode == "seq-mean-token-mean":
        return (token_loss.sum(-1) / loss_mask.sum(-1)).sum() / num_sequences
    if mode == "seq-mean-token-sum-norm":
        return token_loss.sum() / max_new_tokens / num_sequences
    raise ValueError(f"aggregation={mode!r} is not one of {AGGREGATIONS}")


def masked_row_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of each row over its masked slots: (b, T), (b, T) bool -> (b,). Rows must be non-empty."""
    return torch.where(mask, values, 0.0).sum(-1) / mask.sum(-1)
