"""A trained batch's metrics per task and per modality, beside the totals: a task that collapses, or a modality
the policy starts to ignore, shows here while the batch's mean looks fine (ERNIE 5.0's multi-task RL).

Pure: trajectories in, flat metrics out (`task/<name>/...`, `modality/<tag>/...`; a combined verifier's parts as
`verifier/part/<name>`). A one-task, one-modality batch gives no groups: its totals already are its only group.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

from flashreinforce.types import Trajectory


def group_metrics(batch: Sequence[Trajectory], version: int) -> dict[str, float]:
    """reward, pass rate, response length and truncation, lag, episode turns and tool calls (multi-turn), and
    verifier parts (Verdict.parts), per task of a mixture and per modality when there are several."""
    metrics = {f"verifier/part/{k}": v for k, v in _parts(batch).items()}
    for prefix, key in (("task", lambda t: t.prompt.task), ("modality", lambda t: t.prompt.modality)):
        groups = _split(batch, key)
        if len(groups) > 1 or (prefix == "task" and "" not in groups):
            for name, members in groups.items():
                metrics.update({f"{prefix}/{name}/{k}": v for k, v in _summary(members, version).items()})
    return metrics


def _split(batch: Sequence[Trajectory], key: Callable[[Trajectory], str]) -> dict[str, list[Trajectory]]:
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for trajectory in batch:
        groups[key(trajectory)].append(trajectory)
    return dict(groups)


def _summary(members: list[Trajectory], version: int) -> dict[str, float]:
    n = len(members)
    lags = [version - 1 - v for t in members for v, m in zip(t.policy_versions, t.loss_mask) if m]
    summary = {
        "rows": float(n),
        "reward_mean": sum(t.reward for t in members) / n,
        "pass_rate": sum(t.verdict.passed for t in members) / n,
        "response_length": sum(t.response_length for t in members) / n,
        "truncated_fraction": sum(t.finish_reason == "length" for t in members) / n,
        "lag_mean": sum(lags) / len(lags) if lags else 0.0,
    }
    episodes = [t.episode for t in members if t.episode is not None]
    if episodes:
        summary["turns"] = sum(e.turns for e in episodes) / len(episodes)
        summary["tool_calls"] = sum(e.tool_calls for e in episodes) / len(episodes)
    summary.update({f"verifier/{name}": value for name, value in _parts(members).items()})
    return summary


def _parts(members: Sequence[Trajectory]) -> dict[str, float]:
    """The mean reward of each part of a combined verifier (Verdict.parts), over the rows that have it."""
    parts: dict[str, list[float]] = defaultdict(list)
    for trajectory in members:
        for name, value in trajectory.verdict.parts:
            parts[name].append(value)
    return {name: sum(values) / len(values) for name, values in parts.items()}
