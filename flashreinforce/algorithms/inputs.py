"""The two records every objective takes: one slice of the learner batch, and the whole batch's normalizers.

The trainer splits a learner batch into slices (microbatches, data-parallel ranks). Everything that
depends on the whole batch (advantages, WPSM weights, the counts in GlobalNorm) is computed before the
split and travels in these records, so an objective never needs to see another slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)  # tensors have no boolean equality: compare fields yourself
class LossInputs:
    """One slice (microbatch) of the learner batch; tensors are (b, T) unless noted. Validated on construction."""

    policy_logprobs: Tensor
    """log pi_theta of each token under the live weights; carries the gradient."""
    old_logprobs: Tensor
    """log pi_old, recomputed at theta_old, detached. With one optimizer step per batch this equals
    policy_logprobs.detach()."""
    behavior_logprobs: Tensor
    """log mu: what the inference engine reported when it sampled each token."""
    loss_mask: Tensor
    """bool: True for tokens the policy sampled and we train on (no prompt, hint, tool text, padding)."""
    advantages: Tensor
    """(b,) or (b, T), computed on the WHOLE batch before slicing."""
    rewards: Tensor
    """(b,) scalar rewards."""
    entropies: Tensor | None = None
    """Full-vocabulary entropies at theta_old, detached (FlashREINFORCE's entropy filter)."""
    failures: Tensor | None = None
    """(b,) bool explicit failure labels: the verifier said wrong (FlashREINFORCE's entropy filter)."""
    modalities: tuple[str, ...] | None = None
    """Per-row tag selecting MISC's per-modality bands, e.g. ("text", "image", ...)."""
    sequence_weights: Tensor | None = None
    """(b,) extra per-row loss weights >= 0, e.g. WPSM's 1 - alpha * M_i."""
    teacher_logprobs: Tensor | None = None
    """log pi_T of each token under the row's frozen teacher, detached (on-policy distillation, opd)."""

    def __post_init__(self) -> None:
        _check_loss_inputs(self)

    @property
    def num_rows(self) -> int:
        return self.loss_mask.shape[0]

    def rows(self, start: int, stop: int) -> LossInputs:
        """Rows [start, stop) as their own LossInputs: a microbatch. Slicing keeps autograd links."""
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            values[f.name] = None if value is None else value[start:stop]
        return replace(self, **values)


@dataclass(frozen=True)
class GlobalNorm:
    """Normalizers of the WHOLE learner batch (all microbatches and all ranks)."""

    num_sequences: int
    """Global B: rows in the learner batch."""
    num_tokens: int
    """Global count of loss tokens (the token-mean denominator)."""
    reward_mean: float
    """Global batch-mean reward (FlashREINFORCE's baseline)."""
    max_new_tokens: int
    """The constant L of seq-mean-token-sum-norm (Dr.GRPO: the generation budget)."""
    per_row_baselines: bool = False
    """FlashREINFORCE takes the estimator's advantages (each row against its task's mean, algo.options
    baseline=task) instead of R_i - reward_mean."""

    def __post_init__(self) -> None:
        for name in ("num_sequences", "num_tokens", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GlobalNorm.{name}={value!r} must be an int >= 1")
        if isinstance(self.reward_mean, bool) or not isinstance(self.reward_mean, (int, float)) \
                or not math.isfinite(self.reward_mean):
            raise ValueError(f"GlobalNorm.reward_mean={self.reward_mean!r} must be a finite float")


def global_norm(loss_mask: Tensor, rewards: Tensor, *, max_new_tokens: int) -> GlobalNorm:
    """The GlobalNorm of a batch held in one process: (B, T) loss_mask, (B,) rewards.

    Data-parallel trainers sum num_sequences and num_tokens over ranks, and take the reward mean of all
    ranks' rewards, instead.
    """
    return GlobalNorm(
        num_sequences=int(loss_mask.shape[0]),
        num_tokens=int(loss_mask.sum()),
        reward_mean=float(rewards.double().mean()),
        max_new_tokens=max_new_tokens,
    )


def _check_loss_inputs(x: LossInputs) -> None:
    """Shapes, dtypes and finiteness on loss tokens; values off the mask may be anything (NaN too)."""
    policy = x.policy_logprobs
    if policy.ndim != 2 or policy.numel() == 0 or not policy.is_floating_point():
        raise ValueError(f"LossInputs.policy_logprobs must be a non-empty floating (b, T) tensor, got "
                         f"{policy.dtype} {tuple(policy.shape)}")
    shape, b = tuple(policy.shape), policy.shape[0]
    for name in ("old_logprobs", "behavior_logprobs", "loss_mask"):
        if tuple(getattr(x, name).shape) != shape:
            raise ValueError(f"LossInputs.{name} has shape {tuple(getattr(x, name).shape)}, expected {shape} "
                             "like policy_logprobs")
    if x.loss_mask.dtype != torch.bool:
        raise ValueError(f"LossInputs.loss_mask must be bool, got {x.loss_mask.dtype}: use mask.bool()")
    if tuple(x.advantages.shape) not in ((b,), shape) or not x.advantages.is_floating_point():
        raise ValueError(f"LossInputs.advantages must be floating ({b},) or {shape}, got {x.advantages.dtype} "
                         f"{tuple(x.advantages.shape)}")
    if tuple(x.rewards.shape) != (b,):
        raise ValueError(f"LossInputs.rewards must have shape ({b},), got {tuple(x.rewards.shape)}")
    empty = (~x.loss_mask.any(-1)).nonzero()
    if empty.numel():
        raise ValueError(f"LossInputs row {int(empty[0])} has no loss token: drop empty rows before the loss")

    mask = x.loss_mask
    if x.teacher_logprobs is not None and tuple(x.teacher_logprobs.shape) != shape:
        raise ValueError(f"LossInputs.teacher_logprobs has shape {tuple(x.teacher_logprobs.shape)}, expected {shape} "
                         "like policy_logprobs")
    for name in ("policy_logprobs", "old_logprobs", "behavior_logprobs", "teacher_logprobs"):
        if getattr(x, name) is None:
            continue
        values = getattr(x, name).detach()
        bad = mask & (~torch.isfinite(values) | (values > 0))
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"LossInputs.{name}[{row}, {col}] = {float(values[row, col])} on a loss token: "
                             "log-probs must be finite and <= 0 there")
    advantages = x.advantages if x.advantages.ndim == 2 else x.advantages[:, None].expand(shape)
    if not bool(torch.isfinite(advantages[mask]).all()):
        raise ValueError("LossInputs.advantages must be finite on loss tokens")
    if not bool(torch.isfinite(x.rewards).all()):
        raise ValueError(f"LossInputs.rewards must be finite, got {x.rewards.tolist()}")
    if x.modalities is not None and len(x.modalities) != b:
        raise ValueError(f"LossInputs.modalities has {len(x.modalities)} tags for {b} rows: give one per row")
    if x.sequence_weights is not None:
        w = x.sequence_weights
        if tuple(w.shape) != (b,) or not w.is_floating_point() or not bool((torch.isfinite(w) & (w >= 0)).all()):
            raise ValueError(f"LossInputs.sequence_weights must be a finite, >= 0 floating ({b},) tensor, got "
                             f"{w.dtype} {tuple(w.shape)}")
