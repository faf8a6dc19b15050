"""DAPO's data-side components (Yu et al. 2025): overlong reward shaping and the dynamic-sampling filter.

The loss side of DAPO (clip-higher, token-mean) is LOSSES["dapo"]; these two act on rewards and on which
groups enter a batch.
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, *, max_length: int = 20480, cache_length: int = 4096) -> Tensor:
    """Soft overlong punishment R_len, added to the task reward.   (N,) response lengths -> (N,) float

        R_len = 0                                  if |y| <= L_max - L_cache
                ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
                -1                                 if |y| > L_max
    Continuous at L_max - L_cache (0) and -1 at L_max. Example: L_max 10, L_cache 4: lengths
    [6, 8, 10, 11] -> [0, -0.5, -1, -1].
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length ({cache_length}) <= max_length ({max_length})")
    if lengths.ndim != 1 or lengths.is_floating_point() or bool((lengths < 0).any()):
        raise ValueError(f"lengths must be a (N,) tensor of non-negative token counts, got {lengths}")
    soft_limit = max_length - cache_length
    ramp = (soft_limit - lengths).clamp(max=0).to(torch.float32) / cache_length  # (N,) <= 0
    return torch.where(lengths > max_length, -1.0, ramp)


def dynamic_sampling_keep(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Rows whose group has non-constant rewards (0 < #correct < G): the groups DAPO keeps.  (N,) x2 -> (N,) bool

    A group whose rewards are all equal has zero group-relative advantage and only dilutes the batch.
    Example: rewards [1, 1, 0, 1], group_ids [0, 0, 1, 1] -> [False, False, True, True].
    """
    if rewards.shape != group_ids.shape or rewards.ndim != 1 or group_ids.is_floating_point():
        raise ValueError(f"rewards {tuple(rewards.shape)} and integer group_ids {tuple(group_ids.shape)} must be (N,)")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    rewards = rewards.to(torch.float64)
    high = torch.full((groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, rewards, "amax")
    low = torch.full((groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, rewards, "amin")
    return (high > low)[inverse]
