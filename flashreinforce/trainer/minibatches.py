"""A learner batch trained as several optimizer steps (PPO-style mini-batches, as verl's and OpenRLHF's).

The batch's prompt groups are split in order into `n` parts of nearly equal group counts (a group is never split:
a part holds whole groups, whose rows' advantages the whole batch gave). Each part is one optimizer step against
the log-probs the weights had before the first step (theta_old), which is what lets a clip range act: with one
step per batch every ratio to theta_old is 1. A part's loss is normalized over its own rows and tokens, as a step
over those rows alone would be; the baseline (the advantages, FlashREINFORCE's reward mean) stays the whole
batch's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from flashreinforce.algorithms import GlobalNorm


def minibatch_rows(group_ids: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """The rows of each part, in batch order: groups in the order of their first row, cut into `parts` runs of
    nearly equal group counts (fewer parts when there are fewer groups).   (B,) -> [(b_j,) long, ...]

    Example: group_ids [3, 3, 1, 2, 1, 2], parts 2 -> groups in order 3, 1, 2 -> [[0, 1, 2, 4], [3, 5]].
    """
    if parts < 1:
        raise ValueError(f"trainer.minibatches={parts} must be >= 1")
    order = list(dict.fromkeys(group_ids.tolist()))  # groups by first appearance
    parts = min(parts, len(order))
    bounds = [round(j * len(order) / parts) for j in range(parts + 1)]
    part_of = {group: j for j in range(parts) for group in order[bounds[j]:bounds[j + 1]]}
    index = torch.tensor([part_of[g] for g in group_ids.tolist()], device=group_ids.device)
    return [torch.nonzero(index == j).squeeze(1) for j in range(parts)]


def part_norm(norm: GlobalNorm, loss_mask: torch.Tensor, rows: torch.Tensor) -> GlobalNorm:
    """The normalizers of one part: its own rows and loss tokens; the whole batch's reward mean (the baseline)."""
    if rows.numel() == loss_mask.shape[0]:
        return norm
    return replace(norm, num_sequences=int(rows.numel()), num_tokens=int(loss_mask[rows].sum()))


@dataclass(frozen=True, eq=False)
class OldPass:
    """theta_old's log-probs and entropies of one microbatch, taken before the first optimizer step of a batch."""

    logprobs: torch.Tensor  # (b, T) detached
    entropies: torch.Tensor  # (b, T) detached
