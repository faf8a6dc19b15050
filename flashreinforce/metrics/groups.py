"""A trained batch's metrics per task and per modality, beside the totals: a task that collapses, or a modality
the policy starts to ignore, shows here while the batch's mean looks fine (ERNIE 5.0's multi-task RL).

Pure: trajectories in, flat metrics out (`task/<name>/...`, `modality/<tag>/...`; a combined verifier's parts as
`verifier/part/<name>`). A one-task, one-modality batch gives no groups: its totals already are its only group.
The hacking watch (`hacking/...`, in total and per task) reports the share of rows whose Verdict carries each sign
of a response probing the verifier (types.HACKING_SIGNS), and the same share among the rows that got a reward: a
policy drifting toward a hole shows here before a hole pays.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

from flashreinforce.types import HACKING_SIGNS, Trajectory


def group_metrics(batch: Sequence[Trajectory], version: int) -> dict[str, float]:
    """reward, pass rate, response length and truncation, lag, episode turns and tool calls (multi-turn), and
    verifier parts (Verdict.parts), per task of a mixture and per modality when there are several."""
    metrics = {f"verifier/part/{k}": v for k, v in _parts(batch).items()}
    metrics.update(hacking_watch(batch))
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
    summary.update(hacking_watch(members))
    return summary


def hacking_watch(members: Sequence[Trajectory]) -> dict[str, float]:
    """`hacking/<sign>`: the share of the rows whose Verdict carries the sign (`any`: one sign or more);
    `hacking/rewarded/<sign>`: the same among the rows with a reward above 0 (0 when there are none). Empty when
    no row carries a sign: a run whose verifier gives none (math, choice, ...) gets no such keys."""
    if not any(t.verdict.signs for t in members):
        return {}
    signs = sorted(set(HACKING_SIGNS) | {sign for t in members for sign in t.verdict.signs})
    rewarded = [t for t in members if t.reward > 0]
    metrics = {}
    for sign in (*signs, "any"):
        def has(t: Trajectory, sign: str = sign) -> bool:
            return bool(t.verdict.signs) if sign == "any" else sign in t.verdict.signs
        metrics[f"hacking/{sign}"] = sum(map(has, members)) / len(members)
        metrics[f"hacking/rewarded/{sign}"] = sum(map(has, rewarded)) / len(rewarded) if rewarded else 0.0
    return metrics


def _parts(members: Sequence[Trajectory]) -> dict[str, float]:
    """The mean reward of each part of a combined verifier (Verdict.parts), over the rows that have it."""
    parts: dict[str, list[float]] = defaultdict(list)
    for trajectory in members:
        for name, value in trajectory.verdict.parts:
            parts[name].append(value)
    return {name: sum(values) / len(values) for name, values in parts.items()}
