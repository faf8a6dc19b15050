"""The menu: every loss the trainer can run, by name, in one literal dict.

A LossSpec pairs an advantage estimator (run once on the WHOLE batch) with an objective (run on each
slice, given the batch's GlobalNorm) and the options the objective uses when none are given. Adding a
loss is adding one entry. Usage:

    spec = LOSSES["dapo"]
    advantages = spec.advantages(rewards, group_ids, token_counts)   # (N,), whole batch
    loss, stats = spec.objective(slice_inputs, norm, eps_high=0.3)   # any option of spec.defaults
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from types import MappingProxyType
from typing import Any

from torch import Tensor

from flashreinforce.algorithms.advantages import (
    BASELINES,
    WHITEN_OVER,
    flashreinforce_advantages,
    drgrpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from flashreinforce.algorithms.objectives import (
    ClipOptions,
    FlashReinforceOptions,
    MiscOptions,
    OpdOptions,
    clip_objective,
    flashreinforce_objective,
    gspo_objective,
    gspo_token_objective,
    misc_objective,
    opd_objective,
)


@dataclass(frozen=True)
class LossSpec:
    """One loss of the menu."""

    advantages: Callable[..., Tensor]
    """(rewards (N,), group_ids (N,) long, token_counts (N,) long, task_ids=(N,) long or None, **advantage
    options) -> (N,), over the WHOLE batch; token_counts are each row's loss tokens, task_ids its task in a
    mixture (estimators that do not use them ignore them); `advantage_defaults` pre-applied."""
    objective: Callable[..., tuple[Tensor, dict[str, Tensor]]]
    """(inputs: LossInputs, norm: GlobalNorm, **options) -> (loss, stats); `defaults` pre-applied."""
    defaults: Mapping[str, Any]
    """Every option of the objective with the value it takes when not given (read-only)."""
    advantage_options: type | None = None
    """The estimator's options dataclass (e.g. WhitenOptions for REINFORCE++), None when it takes none."""
    objective_options: type | None = None
    """The objective's options dataclass (ClipOptions, MiscOptions, ...), which checks their values."""
    needs_teacher: bool = False
    """The objective reads LossInputs.teacher_logprobs: the trainer scores every row with its task's teacher."""

    @property
    def advantage_defaults(self) -> Mapping[str, Any]:
        """Every option of the advantage estimator with its default (read-only)."""
        return MappingProxyType(asdict(self.advantage_options()) if self.advantage_options else {})

    def split_options(self, options: Mapping[str, Any], loss: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """algo.options -> (advantage options, objective options), the former validated; an option neither
        part knows is an error."""
        known = sorted({*self.defaults, *self.advantage_defaults})
        unknown = sorted(set(options) - set(known))
        if unknown:
            close = {name: difflib.get_close_matches(name, known, n=1) for name in unknown}
            hint = "".join(f" (did you mean {m[0]!r} for {name!r}?)" for name, m in close.items() if m)
            raise ValueError(f"algo.options has unknown option(s) {unknown} for loss {loss!r}{hint}; it accepts "
                             f"{known}")
        advantage = {k: v for k, v in options.items() if k in self.advantage_defaults}
        if self.advantage_options is not None:
            self.advantage_options(**advantage)
        return advantage, {k: v for k, v in options.items() if k not in self.advantage_defaults}

    def check_options(self, options: Mapping[str, Any], loss: str) -> None:
        """Every option known to this loss and of a valid value (ValueError naming it), before any work."""
        _, objective = self.split_options(options, loss)
        if self.objective_options is not None:
            self.objective_options(**{**self.defaults, **objective})


@dataclass(frozen=True)
class WhitenOptions:
    """Options of the REINFORCE++ estimators."""

    whiten: str = "tokens"
    """tokens: normalise over the batch's loss tokens (OpenRLHF, the authors' code, and verl);
    rows: over rows, each counted once."""
    baseline: str = "batch"
    """batch: whiten over the whole batch (the paper); task: over each task's rows alone (a mixture whose tasks'
    rewards differ in scale); the same in a one-task run."""

    def __post_init__(self) -> None:
        if self.whiten not in WHITEN_OVER:
            raise ValueError(f"option whiten={self.whiten!r} is not one of {WHITEN_OVER}")
        if self.baseline not in BASELINES:
            raise ValueError(f"option baseline={self.baseline!r} is not one of {BASELINES}")


@dataclass(frozen=True)
class BaselineOptions:
    """Options of FlashREINFORCE's estimator."""

    baseline: str = "batch"
    """batch: R_i minus the batch mean; task: minus the mean of the row's task in the batch (a mixture whose tasks'
    rewards differ in scale); the same in a one-task run."""

    def __post_init__(self) -> None:
        if self.baseline not in BASELINES:
            raise ValueError(f"option baseline={self.baseline!r} is not one of {BASELINES}")


def _spec(advantages: Callable, objective: Callable, options: object,
          advantage_options: type | None = None, *, needs_teacher: bool = False) -> LossSpec:
    defaults = MappingProxyType(asdict(options))
    estimator = _called_as_every_spec(advantages)
    if advantage_options is not None:
        estimator = partial(estimator, **asdict(advantage_options()))
    return LossSpec(estimator, partial(objective, **defaults), defaults, advantage_options, type(options),
                    needs_teacher)


def _called_as_every_spec(estimator: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """An estimator called the way every LossSpec.advantages is: (rewards, group_ids, token_counts, task_ids=...,
    **options), passing on only the arguments it takes."""
    takes = inspect.signature(estimator).parameters

    def advantages(rewards: Tensor, group_ids: Tensor, token_counts: Tensor, *, task_ids: Tensor | None = None,
                   **options: Any) -> Tensor:
        if "task_ids" in takes:
            options["task_ids"] = task_ids
        return estimator(rewards, group_ids, *([token_counts] if "token_counts" in takes else []), **options)
    return advantages


GSPO_CLIP = ClipOptions(eps_low=3e-4, eps_high=4e-4)  # the GSPO paper's ranges, ~100x tighter than GRPO's

LOSSES: dict[str, LossSpec] = {
    # FlashREINFORCE: one rollout per prompt, batch-mean baseline, detached ratio, sequence trust region.
    "flashreinforce": _spec(flashreinforce_advantages, flashreinforce_objective, FlashReinforceOptions(),
                            BaselineOptions),
    # GRPO: group-normalised advantages, symmetric clip 0.2, seq-mean-token-mean, no KL term.
    "grpo": _spec(grpo_advantages, clip_objective, ClipOptions()),
    # Dr.GRPO: no std in the advantage, token sums over the constant L instead of |o_i|.
    "drgrpo": _spec(drgrpo_advantages, clip_objective, ClipOptions(aggregation="seq-mean-token-sum-norm")),
    # DAPO: clip-higher and token-mean (dynamic sampling and overlong shaping live in dapo.py).
    "dapo": _spec(grpo_advantages, clip_objective, ClipOptions(eps_high=0.28, aggregation="token-mean")),
    "gspo": _spec(grpo_advantages, gspo_objective, GSPO_CLIP),
    "gspo_token": _spec(grpo_advantages, gspo_token_objective, GSPO_CLIP),
    # MISC (ERNIE 5.0): GSPO-token + per-token IcePop mask with per-modality bands.
    "misc": _spec(grpo_advantages, misc_objective, MiscOptions()),
    # RLOO is sequence-level REINFORCE, -(1/k) sum_i A_i log pi(y_i): token sums, here over the constant L.
    "rloo": _spec(rloo_advantages, clip_objective, ClipOptions(aggregation="seq-mean-token-sum-norm")),
    # REINFORCE++: the reward whitened over the batch's tokens (algo.options.whiten=rows: over rows).
    "reinforce++": _spec(reinforce_pp_advantages, clip_objective, ClipOptions(aggregation="token-mean"),
                         WhitenOptions),
    "reinforce++-baseline": _spec(reinforce_pp_baseline_advantages, clip_objective,
                                  ClipOptions(aggregation="token-mean"), WhitenOptions),
    # On-policy distillation: each token's advantage is a frozen teacher's log-prob minus the student's (reverse
    # KL), optionally mixed with the verifier's reward over FlashREINFORCE's baseline; no group needed.
    "opd": _spec(flashreinforce_advantages, opd_objective, OpdOptions(), BaselineOptions, needs_teacher=True),
}
