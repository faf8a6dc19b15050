"""Advantage estimators: (rewards (N,), group_ids (N,)) -> advantages (N,), one per trajectory.

Always called on the WHOLE learner batch, before it is split into microbatches or ranks (normalization is
global): every baseline below is a batch or group statistic. `group_ids` are any integers that tag the
rollouts of one prompt (they need not be contiguous or sorted). Nothing here sees tokens, except that
REINFORCE++'s whitening counts each row's loss tokens (token_counts (N,)).
Standard deviations are the sample (Bessel-corrected) ones, as in TRL and verl [R]; a group of one has
deviation 0, so its advantage is 0.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

STD_EPS = 1e-6
"""Added to a standard deviation before dividing (GRPO's std + 1e-6): a constant group gets A = 0."""


def group_mean(values: Tensor, group_ids: Tensor) -> Tensor:
    """Each row's group mean: out[i] = mean{values[j] : group_ids[j] == group_ids[i]}.   (N,), (N,) -> (N,)

    Example: values [1, 0, 4, 2], group_ids [7, 7, 3, 3] -> [0.5, 0.5, 3, 3].
    Also gives WPSM's current-group accuracy: group_mean(passed.float(), group_ids).
    """
    values = _as_float("values", values)
    inverse, counts = _groups(group_ids, values)
    sums = torch.zeros(counts.shape, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)
    return (sums / counts)[inverse]


def batch_mean_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """FlashREINFORCE / one-rollout REINFORCE: A_i = R_i - mean_j R_j over the whole batch; groups unused."""
    rewards = _as_float("rewards", rewards)
    _groups(group_ids, rewards)  # same shape checks as every estimator, though the ids are unused
    return rewards - rewards.mean()


BASELINES = ("batch", "task")


def flashreinforce_advantages(rewards: Tensor, group_ids: Tensor, *, baseline: str = "batch",
                              task_ids: Tensor | None = None) -> Tensor:
    """FlashREINFORCE's baseline: the batch mean (batch_mean_advantages), or with baseline="task" each row's
    task's mean in the batch, A_i = R_i - mean{R_j : task_j = task_i}, so that tasks whose rewards differ in
    scale do not set each other's baseline. A task with one row in the batch gets A = 0 (count them with
    single_row_tasks).

    Example: rewards [1, 0, 10, 20], tasks [0, 0, 1, 1] -> batch: [-6.75, -7.75, 2.25, 12.25]; task: [0.5, -0.5,
    -5, 5].
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline={baseline!r} is not one of {BASELINES}")
    if baseline == "batch" or task_ids is None:
        return batch_mean_advantages(rewards, group_ids)
    rewards = _as_float("rewards", rewards)
    return rewards - group_mean(rewards, task_ids)


def single_row_tasks(task_ids: Tensor) -> int:
    """Tasks with exactly one row in the batch: under baseline="task" their advantage is 0, they teach nothing."""
    return int((torch.unique(task_ids, return_counts=True)[1] == 1).sum())


def grpo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """GRPO (DeepSeekMath): A_i = (R_i - mean_g R) / (std_g R + 1e-6) within each prompt's group g.

    Example: rewards [1, 0, 0, 0] in one group: mean 0.25, std 0.5 -> [1.5, -0.5, -0.5, -0.5] (to 1e-5).
    """
    rewards = _as_float("rewards", rewards)
    centered = _group_centered(rewards, group_ids, "grpo")
    return centered / (_group_std(centered, group_ids) + STD_EPS)


def drgrpo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr.GRPO (Liu et al. 2025): A_i = R_i - mean_g R; dropping the std removes the difficulty bias."""
    return _group_centered(_as_float("rewards", rewards), group_ids, "drgrpo")


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO: A_i = R_i - mean_{j != i in g} R_j = k/(k-1) (R_i - mean_g R), k = |g| >= 2.

    Example: rewards [1, 0, 0] in one group -> [1 - 0, 0 - 0.5, 0 - 0.5] = [1, -0.5, -0.5].
    """
    rewards = _as_float("rewards", rewards)
    inverse, counts = _groups(group_ids, rewards)
    if bool((counts < 2).any()):
        raise ValueError(f"rloo needs at least 2 rollouts per group (leave-one-out baseline); group sizes are "
                         f"{counts.tolist()}: raise the group size or use batch_mean_advantages")
    k = counts[inverse]  # (N,)
    return k / (k - 1) * (rewards - group_mean(rewards, group_ids))


WHITEN_OVER = ("tokens", "rows")
"""What REINFORCE++ whitening averages over: every loss token of the batch (OpenRLHF, the authors' code, and
verl) or every row once."""


def reinforce_pp_advantages(rewards: Tensor, group_ids: Tensor, token_counts: Tensor | None = None, *,
                            whiten: str = "tokens", baseline: str = "batch", task_ids: Tensor | None = None) -> Tensor:
    """REINFORCE++ (Hu et al. 2025) without a reference-KL term: the reward whitened over the GLOBAL batch.

    With beta = 0 the return of every token of y_i is R_i. whiten="tokens" (default, as OpenRLHF and verl)
    normalises those per-token returns over the batch's loss tokens, so row i counts T_i = token_counts[i]
    times: mean m = sum T_i R_i / sum T_i, variance v = sum T_i (R_i - m)^2 / sum T_i (OpenRLHF's, no Bessel
    correction), A_i = (R_i - m) / sqrt(max(v, 1e-8)). whiten="rows" counts each row once (sample std + 1e-6):
    long rows weigh no more than short ones. group_ids are unused. baseline="task" whitens each task's rows over
    that task's alone (a mixture whose tasks' rewards differ in scale: each task's advantages then have mean 0
    and variance 1 on their own, whatever the other tasks' rewards); one task gives the batch's.
    Example: rewards [1, 0], token_counts [3, 1]: m = 0.75, v = 0.1875, A = [0.577, -1.732].
    """
    rewards = _as_float("rewards", rewards)
    _groups(group_ids, rewards)
    return _whiten_by(rewards, token_counts, whiten, baseline, task_ids)


def reinforce_pp_baseline_advantages(rewards: Tensor, group_ids: Tensor, token_counts: Tensor | None = None, *,
                                     whiten: str = "tokens", baseline: str = "batch",
                                     task_ids: Tensor | None = None) -> Tensor:
    """REINFORCE++-baseline: subtract each group's mean reward, then whiten over the GLOBAL batch (as above), or
    with baseline="task" over each task's rows (a group never spans tasks)."""
    centered = _group_centered(_as_float("rewards", rewards), group_ids, "reinforce++-baseline")
    return _whiten_by(centered, token_counts, whiten, baseline, task_ids)


def _whiten_by(x: Tensor, token_counts: Tensor | None, over: str, baseline: str, task_ids: Tensor | None) -> Tensor:
    if baseline not in BASELINES:
        raise ValueError(f"baseline={baseline!r} is not one of {BASELINES}")
    if baseline == "batch" or task_ids is None:
        return _whiten(x, token_counts, over)
    if token_counts is None:  # rows need no counts; tokens without them fail in _whiten, saying so
        return within_tasks(lambda values: _whiten(values, None, over), task_ids, x)
    return within_tasks(lambda values, counts: _whiten(values, counts, over), task_ids, x, token_counts)


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


def _whiten(x: Tensor, token_counts: Tensor | None, over: str) -> Tensor:
    if over == "rows":
        centered = x - x.mean()
        std = (centered.square().sum() / max(x.numel() - 1, 1)).sqrt()
        return centered / (std + STD_EPS)
    if over != "tokens":
        raise ValueError(f"whiten={over!r} is not one of {WHITEN_OVER}")
    if token_counts is None or token_counts.shape != x.shape or bool((token_counts < 1).any()):
        raise ValueError("whiten='tokens' needs token_counts: each row's number of loss tokens (>= 1), shaped "
                         f"like the rewards {tuple(x.shape)}; or whiten='rows'")
    weights = token_counts.to(x.dtype)
    mean = (weights * x).sum() / weights.sum()
    variance = (weights * (x - mean).square()).sum() / weights.sum()
    return (x - mean) * variance.clamp(min=1e-8).rsqrt()


def _group_centered(rewards: Tensor, group_ids: Tensor, name: str) -> Tensor:
    _, counts = _groups(group_ids, rewards)
    singletons = int((counts == 1).sum())
    if singletons:
        # The classic one-rollout-per-prompt trap: a group of one is its own baseline, A = 0, no signal.
        warnings.warn(f"{name}: {singletons} of {counts.numel()} groups have a single rollout, so their advantage "
                      "is 0 and they teach nothing; use G >= 2 rollouts per prompt, or batch_mean_advantages",
                      RuntimeWarning, stacklevel=3)
    return rewards - group_mean(rewards, group_ids)


def _group_std(centered: Tensor, group_ids: Tensor) -> Tensor:
    """Each row's group sample std, from already group-centred values.   (N,) -> (N,)"""
    inverse, counts = _groups(group_ids, centered)
    squares = torch.zeros(counts.shape, dtype=centered.dtype, device=centered.device)
    squares.index_add_(0, inverse, centered.square())
    return (squares / (counts - 1).clamp_min(1)).sqrt()[inverse]


def _groups(group_ids: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """(inverse (N,) long: each row's group index, counts (G,) in values' dtype) after validation."""
    if group_ids.shape != values.shape or group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor shaped like rewards {tuple(values.shape)}, got "
                         f"{group_ids.dtype} {tuple(group_ids.shape)}")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inverse, counts.to(values.dtype)


def _as_float(name: str, values: Tensor) -> Tensor:
    if values.ndim != 1 or values.numel() == 0:
        raise ValueError(f"{name} must be a non-empty (N,) tensor, got shape {tuple(values.shape)}")
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"{name} must be finite, got {values.tolist()}")
    # Low-precision rewards would round the baselines; fp64 stays fp64 for exact checks.
    return values.to(torch.float64 if values.dtype == torch.float64 else torch.float32)
