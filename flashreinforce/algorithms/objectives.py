"""Objectives: (LossInputs, GlobalNorm, **options) -> (loss, stats), evaluable on any slice of a batch.

Each objective returns the slice's SHARE of the full-batch loss (normalised by GlobalNorm, never by the
slice), so summing slice losses and their gradients gives the full batch's (normalization is global).

Stats are detached. Per-row stats are (b,) tensors: concatenate them over slices. Scalar stats are the
slice's share of a batch figure (already divided by the global token or sequence count): SUM them over
slices. The PPO/GSPO family reports:
    clip_fraction               loss tokens whose gradient the trust-region clip removes
    mismatch/masked_fraction    loss tokens whose mismatch weight is 0 (rejected by TIS/MIS/IcePop/...)
    mismatch/masked_tokens      per row, how many of its loss tokens that is
    mismatch/weight_mean        mean mismatch weight over loss tokens
    mismatch/kl                 k3 estimate of KL(mu || pi_old): mean of rho - 1 - log rho over loss tokens
    sequence_ratio              per row, GSPO's s_i (gspo, gspo_token, misc only)
opd also reports reverse_kl (per token: the k1 estimate of KL(pi_S || pi_T), summed over slices) and, per row,
sequence_reverse_kl (that row's sum over its tokens).
flashreinforce reports the reference's stats: per row advantages, sequence_kl, admitted, policy_tokens,
retained_tokens; the scalar acceptance_rate (admitted rows / global B).
Options are keyword arguments validated by the dataclasses below; an unknown option or a bad value raises
ValueError naming it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from flashreinforce.algorithms.aggregation import AGGREGATIONS, aggregate
from flashreinforce.algorithms.distill import sequence_reverse_kl, teacher_signal
from flashreinforce.algorithms.flashreinforce import flashreinforce_loss
from flashreinforce.algorithms.inputs import GlobalNorm, LossInputs
from flashreinforce.algorithms.mismatch import (
    ICEPOP_WEIGHTS,
    MISMATCH_MODES,
    icepop_weights,
    log_ratio,
    mismatch_weights,
)
from flashreinforce.algorithms.surrogates import gspo_log_ratio, gspo_token_ratio, ppo_clip

MISC_IMPLS = ("token", "value_mask")


@dataclass(frozen=True)
class ClipOptions:
    """Options of the PPO-clip objectives (grpo, drgrpo, dapo, rloo, reinforce++) and of gspo/gspo_token."""

    eps_low: float = 0.2
    """Clip range below 1: r < 1 - eps_low stops a negative-advantage token's gradient."""
    eps_high: float = 0.2
    """Clip range above 1 (DAPO clip-higher: 0.28; GSPO: 4e-4)."""
    aggregation: str = "seq-mean-token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum-norm (see aggregation.py)."""
    mismatch: str = "none"
    """Train/inference mismatch correction: none | tis | seq_tis | mis | seq_mis | icepop | seq_icepop | geo_rs."""
    mismatch_cap: float = 2.0
    """C of tis / seq_tis / mis / seq_mis (slime's --tis-clip default)."""
    icepop_band: tuple[float, float] = (0.5, 5.0)
    """Inclusive [alpha, beta] band of icepop on each token's rho (IcePop's values)."""
    seq_icepop_band: tuple[float, float] = (0.99, 1.01)
    """Inclusive band of seq_icepop (ERNIE eq. 2) on each row's geometric-mean rho, its own setting: a mean over a
    row's tokens lies far closer to 1 than the tokens' ratios do, so IcePop's token band [0.5, 5] never removes a
    row. Set it from the run's mismatch/seq_ratio_* metrics (the rows' geometric means: min, p01, p50, p99, max)."""
    icepop_weight: str = "ratio"
    """ratio: an in-band token weighs rho (IcePop); binary: it weighs 1 (token rejection sampling)."""
    geo_rs_band: tuple[float, float] = (0.999, 1.001)
    """Inclusive band on the geometric-mean rho of geo_rs (verl suggests 1.0001 to 1.001 above 1)."""

    def __post_init__(self) -> None:
        _check_eps(self.eps_low, self.eps_high, "")
        _check_choice("aggregation", self.aggregation, AGGREGATIONS)
        _check_choice("mismatch", self.mismatch, MISMATCH_MODES)
        _check_choice("icepop_weight", self.icepop_weight, ICEPOP_WEIGHTS)
        if not _is_number(self.mismatch_cap) or not 0 < self.mismatch_cap < math.inf:
            raise ValueError(f"option mismatch_cap={self.mismatch_cap!r} must be a finite number > 0")
        _check_band("icepop_band", self.icepop_band)
        _check_band("seq_icepop_band", self.seq_icepop_band)
        _check_band("geo_rs_band", self.geo_rs_band)


@dataclass(frozen=True)
class MiscOptions:
    """Options of MISC (ERNIE 5.0 eq. 3): GSPO-token with a per-token IcePop mask, bands per modality."""

    eps_low: float = 3e-4
    """Sequence-ratio clip range below 1 (the GSPO value)."""
    eps_high: float = 4e-4
    """Sequence-ratio clip range above 1 (the GSPO value)."""
    icepop_band: tuple[float, float] = (0.5, 5.0)
    """Inclusive [alpha, beta] on the token rho = pi_old / mu, for rows whose modality is not in the table."""
    icepop_weight: str = "ratio"
    """ratio (ERNIE eq. 1: an in-band token weighs rho) | binary."""
    modality_bands: Mapping[str, tuple[float, float, float, float]] = field(default_factory=dict)
    """modality tag -> (alpha, beta, eps_low, eps_high); untagged rows and tags not listed use the globals."""
    misc_impl: str = "token"
    """token: the mask removes a token's own gradient (GSPO-token form, our reading of eq. 3);
    value_mask: the mask scales a per-token copy of the sequence loss (slime's GSPO + icepop ablation)."""
    aggregation: str = "seq-mean-token-mean"
    """As in ClipOptions; ERNIE's equations are seq-mean-token-mean."""

    def __post_init__(self) -> None:
        _check_eps(self.eps_low, self.eps_high, "")
        _check_band("icepop_band", self.icepop_band)
        _check_choice("icepop_weight", self.icepop_weight, ICEPOP_WEIGHTS)
        _check_choice("misc_impl", self.misc_impl, MISC_IMPLS)
        _check_choice("aggregation", self.aggregation, AGGREGATIONS)
        if not isinstance(self.modality_bands, Mapping):
            raise ValueError(f"option modality_bands must map a modality tag to (alpha, beta, eps_low, eps_high), "
                             f"got {self.modality_bands!r}")
        for tag, bands in self.modality_bands.items():
            if not isinstance(bands, (tuple, list)) or len(bands) != 4:
                raise ValueError(f"option modality_bands[{tag!r}]={bands!r} must be (alpha, beta, eps_low, eps_high)")
            _check_band(f"modality_bands[{tag!r}] band", tuple(bands[:2]))
            _check_eps(bands[2], bands[3], f"modality_bands[{tag!r}] ")


@dataclass(frozen=True)
class OpdOptions(ClipOptions):
    """Options of on-policy distillation (ALGORITHMS.md 8c): the PPO-clip objective's, on a per-token advantage
    mixed from a teacher's signal and the verifier's outcome advantage."""

    aggregation: str = "token-mean"
    """As in ClipOptions; token-mean by default, so a row weighs by its tokens and the loss follows the sequences'
    summed reverse KL."""
    kl_weight: float = 1.0
    """w_kl: weight of the teacher's per-token signal sg[log pi_T - log pi_S] in each token's advantage."""
    reward_weight: float = 0.0
    """w_rl: weight of the verifier's outcome advantage (the reward minus the batch's mean, or the task's with
    baseline=task), added to every token of the row; 0: distillation alone."""
    kl_clip: float | None = None
    """c: each token's teacher signal clipped to [-c, c] before weighting (None: unclipped)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("kl_weight", "reward_weight"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 <= value < math.inf:
                raise ValueError(f"option {name}={value!r} must be a finite number >= 0")
        if self.kl_weight == 0 and self.reward_weight == 0:
            raise ValueError("options kl_weight and reward_weight are both 0: the loss would train nothing; give "
                             "kl_weight > 0 (distillation) and/or reward_weight > 0 (the verifier's reward)")
        if self.kl_clip is not None and (not _is_number(self.kl_clip) or not 0 < self.kl_clip < math.inf):
            raise ValueError(f"option kl_clip={self.kl_clip!r} must be a finite number > 0, or null for no clip")


@dataclass(frozen=True)
class FlashReinforceOptions:
    """Options of FlashREINFORCE (ALGORITHMS.md section 6); validated by flashreinforce_loss."""

    delta: float = 3e-3
    """Sequence trust region: a row is admitted iff its mean Bernoulli KL <= delta (math.inf: all rows)."""
    negative_token_fraction: float = 1.0
    """q: failed rows keep their ceil(q T_i) highest-entropy tokens (1.0: the base method)."""


def flashreinforce_objective(inputs: LossInputs, norm: GlobalNorm, **options) -> tuple[Tensor, dict[str, Tensor]]:
    """FlashREINFORCE on a slice: flashreinforce_loss with the batch's reward mean and B.

    The baseline is part of the method (A_i = R_i - global mean reward), so this reads inputs.rewards and
    norm.reward_mean, not inputs.advantages, unless norm.per_row_baselines (baseline=task: the estimator's). old_logprobs is not read either: the ratio and the KL gate use
    sg[policy_logprobs], as in the reference. sequence_weights (e.g. WPSM) scale each row's loss.
    """
    o = parse_options(FlashReinforceOptions, options, "flashreinforce")
    return flashreinforce_loss(
        inputs.policy_logprobs,
        inputs.behavior_logprobs,
        inputs.rewards,
        inputs.loss_mask,
        delta=o.delta,
        negative_token_fraction=o.negative_token_fraction,
        entropies=inputs.entropies,
        failures=inputs.failures,
        reward_mean=norm.reward_mean,
        num_sequences=norm.num_sequences,
        sequence_weights=inputs.sequence_weights,
        advantages=inputs.advantages if norm.per_row_baselines else None,
    )


def clip_objective(inputs: LossInputs, norm: GlobalNorm, **options) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip per token with an optional mismatch correction (GRPO, Dr.GRPO, DAPO, RLOO, REINFORCE++).

        r_ij = exp(log pi_theta - log pi_old),   w_ij = mismatch weight of rho_ij = pi_old / mu (detached)
        l_ij = - c_i w_ij min(r_ij A_ij, clip(r_ij, 1 - eps_low, 1 + eps_high) A_ij),   aggregated by mode
    with c_i the optional sequence_weights. No reference-KL term (beta = 0, as DAPO and Dr.GRPO).
    """
    o = parse_options(ClipOptions, options, "clip")
    x = _Slice.of(inputs, norm)
    ratio = log_ratio(x.policy, x.old, x.mask).exp()  # (b, T)
    surrogate, clipped = ppo_clip(ratio, x.advantages, o.eps_low, o.eps_high)  # (b, T)
    weights = _mismatch(o, x)  # (b, T)
    return _finish(x, surrogate, weights, clipped, o.aggregation, {})


def gspo_objective(inputs: LossInputs, norm: GlobalNorm, **options) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): one clipped ratio per sequence.

        s_i = exp((1/|y_i|) sum_j log r_ij),   l_i = - min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
    Computed in the GSPO-token form (as verl does), which with per-sequence advantages equals GSPO in value,
    clip and gradient. Only that form attaches a token-level mismatch weight (tis, mis, icepop) to its own
    token's gradient: multiplying the sequence loss by the row's mean weight instead would still give a token
    that IcePop rejects the gradient of its neighbours. Advantages must be per sequence (b,).
    """
    if inputs.advantages.ndim != 1:
        raise ValueError("gspo needs per-sequence advantages (b,); for per-token advantages use gspo_token")
    return _gspo_token(parse_options(ClipOptions, options, "gspo"), _Slice.of(inputs, norm))


def gspo_token_objective(inputs: LossInputs, norm: GlobalNorm, **options) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token: s_ij = sg[s_i] pi_theta(y_ij) / sg[pi_theta(y_ij)] clipped per token with A_ij.

    Equal to GSPO (value, clip, gradient) when A_ij = A_i, and a token weight of 0 removes exactly that
    token's gradient.
    """
    return _gspo_token(parse_options(ClipOptions, options, "gspo_token"), _Slice.of(inputs, norm))


def _gspo_token(o: ClipOptions, x: _Slice) -> tuple[Tensor, dict[str, Tensor]]:
    ratio = gspo_token_ratio(log_ratio(x.policy, x.old, x.mask), x.mask)  # (b, T), value s_i
    surrogate, clipped = ppo_clip(ratio, x.advantages, o.eps_low, o.eps_high)
    return _finish(x, surrogate, _mismatch(o, x), clipped, o.aggregation, {"sequence_ratio": ratio.detach()[:, 0]})


def misc_objective(inputs: LossInputs, norm: GlobalNorm, **options) -> tuple[Tensor, dict[str, Tensor]]:
    """MISC (ERNIE 5.0 eq. 3): the sequence ratio clips policy drift, a token mask gates the mismatch.

        l_ij = - c_i M(rho_ij; a, b) min(s_ij A_i, clip(s_ij, 1 - eps_low, 1 + eps_high) A_i)
    M(k; a, b) = k if a <= k <= b else 0 (inclusive; detached); s_ij is GSPO-token's ratio, so an
    out-of-band token loses exactly its own gradient. s_i runs over ALL loss tokens and |y_i| is not
    reduced for masked ones. (a, b, eps_low, eps_high) come per row from modality_bands[modality].
    """
    o = parse_options(MiscOptions, options, "misc")
    x = _Slice.of(inputs, norm)
    low, high, eps_low, eps_high = _row_bands(o, inputs.modalities, x.policy)
    token_log_ratio = log_ratio(x.policy, x.old, x.mask)  # (b, T)
    if o.misc_impl == "token":
        ratio = gspo_token_ratio(token_log_ratio, x.mask)  # (b, T) value s_i
    else:
        ratio = gspo_log_ratio(token_log_ratio, x.mask).exp()[:, None].expand_as(x.policy)  # (b, T) grad via s_i
    surrogate, clipped = ppo_clip(ratio, x.advantages, eps_low, eps_high)  # (b, T)
    weights = icepop_weights(x.log_rho, x.mask, low, high, o.icepop_weight)  # (b, T)
    return _finish(x, surrogate, weights, clipped, o.aggregation, {"sequence_ratio": ratio.detach()[:, 0]})


def opd_objective(inputs: LossInputs, norm: GlobalNorm, **options) -> tuple[Tensor, dict[str, Tensor]]:
    """On-policy distillation: PPO-clip per token on an advantage from a frozen teacher (ALGORITHMS.md 8c).

        a_ij = clip(sg[log pi_T(y_ij) - log pi_old(y_ij)], -c, c)        the teacher's signal (distill.py)
        A_ij = w_kl a_ij + w_rl A_i                                      A_i: the verifier's outcome advantage
        l_ij = - c_i w_ij min(r_ij A_ij, clip(r_ij, 1 - eps_low, 1 + eps_high) A_ij),   aggregated by mode
    with w_ij the mismatch weight of rho_ij = pi_old / mu (the student's train-inference gap) and c_i the optional
    sequence_weights. With one optimizer step per batch (r = 1) and no mismatch correction, its gradient is that of
    sum_ij (log pi_theta - log pi_T)^2 / 2 aggregated alike, and its expectation under pi_S the gradient of the
    reverse KL. Needs inputs.teacher_logprobs.
    """
    o = parse_options(OpdOptions, options, "opd")
    if inputs.teacher_logprobs is None:
        raise ValueError("opd needs the teacher's log-probs of every row (LossInputs.teacher_logprobs): name a "
                         "teacher for each task (teachers:)")
    x = _Slice.of(inputs, norm)
    teacher = torch.where(x.mask, inputs.teacher_logprobs.detach().to(x.old.dtype), 0.0)  # (b, T)
    advantages = o.kl_weight * teacher_signal(teacher, x.old, x.mask, clip=o.kl_clip)  # (b, T)
    if o.reward_weight:
        advantages = advantages + o.reward_weight * x.advantages
    ratio = log_ratio(x.policy, x.old, x.mask).exp()  # (b, T)
    surrogate, clipped = ppo_clip(ratio, advantages, o.eps_low, o.eps_high)  # (b, T)
    sequence_kl = sequence_reverse_kl(teacher, x.old, x.mask)  # (b,) unclipped
    stats = {"reverse_kl": sequence_kl.sum() / x.norm.num_tokens, "sequence_reverse_kl": sequence_kl}
    return _finish(x, surrogate, _mismatch(o, x), clipped, o.aggregation, stats)


def parse_options(kind: type, options: Mapping[str, object], name: str):
    """Build the `kind` options dataclass from keyword options; ValueError for an unknown name."""
    known = {f.name for f in fields(kind)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; known options are {sorted(known)}")
    return kind(**options)


@dataclass(frozen=True, eq=False)
class _Slice:
    """A validated slice in compute precision: every tensor finite, 0 off the mask."""

    policy: Tensor  # (b, T) with gradient
    old: Tensor  # (b, T) detached
    behavior: Tensor  # (b, T) detached
    mask: Tensor  # (b, T) bool
    advantages: Tensor  # (b, 1) or (b, T)
    sequence_weights: Tensor | None  # (b, 1)
    log_rho: Tensor  # (b, T) log pi_old - log mu, guarded, detached
    norm: GlobalNorm

    @staticmethod
    def of(inputs: LossInputs, norm: GlobalNorm) -> _Slice:
        mask = inputs.loss_mask
        if inputs.num_rows > norm.num_sequences or int(mask.sum()) > norm.num_tokens:
            raise ValueError(f"slice of {inputs.num_rows} rows / {int(mask.sum())} loss tokens exceeds GlobalNorm "
                             f"({norm.num_sequences} rows / {norm.num_tokens} tokens): GlobalNorm must count the "
                             "whole learner batch")
        # bf16/fp16 are promoted before any exp; fp64 stays fp64 for exact checks.
        dtype = torch.float64 if inputs.policy_logprobs.dtype == torch.float64 else torch.float32

        def clean(t: Tensor) -> Tensor:  # where() first: NaN off the mask must never reach autograd
            return torch.where(mask, t.to(dtype), 0.0)

        advantages = inputs.advantages.detach()
        advantages = clean(advantages) if advantages.ndim == 2 else advantages.to(dtype)[:, None]
        old, behavior = clean(inputs.old_logprobs.detach()), clean(inputs.behavior_logprobs.detach())
        weights = inputs.sequence_weights
        return _Slice(
            policy=clean(inputs.policy_logprobs),
            old=old,
            behavior=behavior,
            mask=mask,
            advantages=advantages,
            sequence_weights=None if weights is None else weights.detach().to(dtype)[:, None],
            log_rho=log_ratio(old, behavior, mask),
            norm=norm,
        )


def _mismatch(o: ClipOptions, x: _Slice) -> Tensor:
    return mismatch_weights(o.mismatch, x.log_rho, x.mask, cap=o.mismatch_cap, icepop_band=o.icepop_band,
                            icepop_weight=o.icepop_weight, geo_rs_band=o.geo_rs_band,
                            seq_icepop_band=o.seq_icepop_band)


def _finish(
    x: _Slice,
    surrogate: Tensor,
    weights: Tensor,
    clipped: Tensor,
    aggregation: str,
    stats: dict[str, Tensor],
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weight, negate and aggregate the (b, T) surrogate; add the shared scalar stats (token shares).

    `weights` are the detached mismatch weights; the sequence weights (WPSM) multiply them here, after
    the mismatch stats are taken.
    """
    n = torch.tensor(float(x.norm.num_tokens), dtype=x.policy.dtype, device=x.mask.device)  # stats in loss precision
    rho_terms = torch.where(x.mask, x.log_rho.exp() - 1 - x.log_rho, 0.0)  # k3: rho - 1 - log rho >= 0
    stats = {
        **stats,
        "clip_fraction": (clipped & x.mask).sum() / n,
        "mismatch/masked_fraction": ((weights == 0) & x.mask).sum() / n,
        "mismatch/masked_tokens": ((weights == 0) & x.mask).sum(-1),  # (b,): per task and modality in the trainer
        "mismatch/weight_mean": torch.where(x.mask, weights, 0.0).sum() / n,
        "mismatch/kl": rho_terms.sum() / n,
    }
    if x.sequence_weights is not None:
        weights = weights * x.sequence_weights
    token_loss = -(weights * surrogate)  # (b, T)
    loss = aggregate(token_loss, x.mask, aggregation, num_sequences=x.norm.num_sequences,
                     num_tokens=x.norm.num_tokens, max_new_tokens=x.norm.max_new_tokens)
    return loss, stats


def _row_bands(o: MiscOptions, modalities: tuple[str, ...] | None, like: Tensor):
    """Per-row (alpha, beta, eps_low, eps_high): floats when uniform, else four (b, 1) tensors."""
    default = (*o.icepop_band, o.eps_low, o.eps_high)
    if modalities is None or not o.modality_bands:
        return default
    table = torch.tensor([o.modality_bands.get(tag, default) for tag in modalities], dtype=like.dtype,
                         device=like.device)  # (b, 4)
    return tuple(table[:, k : k + 1] for k in range(4))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"option {name}={value!r} is not one of {choices}")


def _check_eps(low: object, high: object, prefix: str) -> None:
    if not _is_number(low) or not 0 <= low < 1:
        raise ValueError(f"option {prefix}eps_low={low!r} must be a number in [0, 1)")
    if not _is_number(high) or not 0 <= high < math.inf:
        raise ValueError(f"option {prefix}eps_high={high!r} must be a finite number >= 0")


def _check_band(name: str, band: object) -> None:
    if (not isinstance(band, (tuple, list)) or len(band) != 2 or not all(_is_number(v) for v in band)
            or not 0 <= band[0] <= band[1] < math.inf):
        raise ValueError(f"option {name}={band!r} must be (low, high) with 0 <= low <= high < inf")
