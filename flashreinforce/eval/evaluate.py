"""Held-out evaluation: k samples per prompt -> avg@k and unbiased pass@k, overall and per data_source.

Runs on any Backend (the training run's own engine while it is paused, or a fresh one built from a
checkpoint by `flashreinforce eval`). It never touches the trainer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from flashreinforce.algorithms.passk import pass_at_k
from flashreinforce.controller.backend import Backend
from flashreinforce.controller.episodes import EpisodeBackend
from flashreinforce.controller.loop import request_seed
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.types import Prompt, RolloutKey, SamplingParams


@dataclass(frozen=True)
class SourceScore:
    num_prompts: int
    avg_at_k: float
    """Mean fraction of correct samples, in percent (the unbiased pass@1 with n = k)."""
    pass_at: dict[int, float]
    """Unbiased pass@k' in percent for k' = 1, 2, 4, ... <= k."""


@dataclass(frozen=True)
class EvalReport:
    k: int
    temperature: float
    top_p: float
    max_new_tokens: int
    overall: SourceScore
    by_source: dict[str, SourceScore]
    correct: dict[str, int]
    """Correct samples (of k) per prompt id."""
    mean_turns: float | None = None
    """Multi-turn runs: model turns per episode."""
    mean_tool_calls: float | None = None
    """Multi-turn runs: tool calls per episode."""

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        flat = {f"{prefix}/avg@k": self.overall.avg_at_k}
        if self.mean_turns is not None:
            flat[f"{prefix}/turns"] = self.mean_turns
            flat[f"{prefix}/tool_calls"] = self.mean_tool_calls
        for kk, value in self.overall.pass_at.items():
            flat[f"{prefix}/pass@{kk}"] = value
        if len(self.by_source) > 1:
            for source, score in self.by_source.items():
                flat[f"{prefix}/{source}/avg@k"] = score.avg_at_k
        return flat

    def describe(self) -> str:
        ks = ", ".join(f"pass@{kk} {v:.1f}" for kk, v in self.overall.pass_at.items())
        lines = [f"avg@{self.k} {self.overall.avg_at_k:.1f}% ({ks}) on {self.overall.num_prompts} prompts, "
                 f"T={self.temperature}, top-p={self.top_p}, max {self.max_new_tokens} new tokens"]
        if len(self.by_source) > 1:
            for source, score in sorted(self.by_source.items()):
                lines.append(f"  {source}: avg@{self.k} {score.avg_at_k:.1f}% on {score.num_prompts} prompts")
        return "\n".join(lines)


def _score(correct_counts: Sequence[int], k: int) -> SourceScore:
    ks = [kk for kk in (1, 2, 4, 8, 16, 32, 64) if kk <= k]
    if k not in ks:
        ks.append(k)
    n = len(correct_counts)
    return SourceScore(
        num_prompts=n,
        avg_at_k=100.0 * sum(c / k for c in correct_counts) / n,
        pass_at={kk: 100.0 * sum(pass_at_k(k, c, kk) for c in correct_counts) / n for kk in ks},
    )


async def evaluate(
    backend: Backend,
    episodes: TextEpisodes,
    prompts: Sequence[Prompt],
    *,
    k: int,
    params: SamplingParams,
    seed: int,
) -> EvalReport:
    """Run k episodes per prompt (seeded per sample, so a checkpoint always scores the same)."""
    if not prompts:
        raise ValueError("evaluation needs at least one prompt")
    if not isinstance(backend, EpisodeBackend):
        backend = EpisodeBackend(backend, episodes)
    by_id: dict[str, tuple[Prompt, int]] = {}
    for prompt in prompts:
        for sample in range(k):
            key = RolloutKey(prompt.id, sample)
            rid = f"eval:{prompt.id}#{sample}"
            by_id[rid] = (prompt, sample)
            backend.start(rid, prompt, replace(params, seed=request_seed(seed, key)))
    correct: dict[str, int] = defaultdict(int)
    turns: list[int] = []
    tool_calls: list[int] = []
    remaining = len(by_id)
    while remaining:
        finished = await backend.finished()
        strays = [g.request_id for g in finished if g.request_id not in by_id]
        assert not strays, f"evaluation must own the engine, but {strays[:3]} also finished"
        verdicts = await backend.judge(finished)
        for generation, verdict in zip(finished, verdicts):
            correct[by_id[generation.request_id][0].id] += int(verdict.passed)
            if generation.episode is not None:
                turns.append(generation.episode.turns)
                tool_calls.append(generation.episode.tool_calls)
        remaining -= len(finished)
    sources: dict[str, list[int]] = defaultdict(list)
    for prompt in prompts:
        sources[prompt.data_source].append(correct[prompt.id])
    return EvalReport(
        k=k,
        temperature=params.temperature,
        top_p=params.top_p,
        max_new_tokens=params.max_new_tokens,
        overall=_score([correct[p.id] for p in prompts], k),
        by_source={source: _score(counts, k) for source, counts in sources.items()},
        correct={p.id: correct[p.id] for p in prompts},
        mean_turns=sum(turns) / len(turns) if turns else None,
        mean_tool_calls=sum(tool_calls) / len(tool_calls) if tool_calls else None,
    )
