"""Held-out evaluation: k samples per prompt -> avg@k and unbiased pass@k, overall and per data_source; with
`greedy`, one greedy decode per prompt too -> greedy accuracy and the share of distinct greedy answers.

avg@k alone can hide a collapse: a run that learned to answer "2" to every GCD problem raised its sampled
avg@2 from 18% to 28% (measured). Greedy accuracy and distinct answers (a collapsed policy gives the same
answer to every prompt) show it.

Runs on any Backend (the training run's own engine while it is paused, or a fresh one built from a
checkpoint by `flashreinforce eval`). It never touches the trainer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from flashreinforce.algorithms.passk import pass_at_k
from flashreinforce.controller.backend import Backend
from flashreinforce.controller.episodes import EpisodeBackend
from flashreinforce.controller.loop import request_seed
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.types import Generation, Prompt, RolloutKey, SamplingParams
from flashreinforce.verifiers.math import extract_answer


@dataclass(frozen=True)
class SourceScore:
    num_prompts: int
    avg_at_k: float
    """Mean fraction of correct samples, in percent (the unbiased pass@1 with n = k)."""
    pass_at: dict[int, float]
    """Unbiased pass@k' in percent for k' = 1, 2, 4, ... <= k."""
    distinct_answers: float
    """Distinct final answers as a percent of prompts: of the greedy answers, else of each prompt's first sample."""
    greedy_accuracy: float | None = None
    """Percent of prompts whose greedy decode is correct (None without a greedy pass)."""


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
    by_task: dict[str, SourceScore] = field(default_factory=dict)
    """A mixture's scores per task (each task's prompts with its own verifier); {} for one task."""
    mean_turns: float | None = None
    """Multi-turn runs: model turns per episode."""
    mean_tool_calls: float | None = None
    """Multi-turn runs: tool calls per episode."""

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        flat = {f"{prefix}/avg@k": self.overall.avg_at_k, f"{prefix}/distinct_answers": self.overall.distinct_answers}
        if self.overall.greedy_accuracy is not None:
            flat[f"{prefix}/greedy_accuracy"] = self.overall.greedy_accuracy
        if self.mean_turns is not None:
            flat[f"{prefix}/turns"] = self.mean_turns
            flat[f"{prefix}/tool_calls"] = self.mean_tool_calls
        for kk, value in self.overall.pass_at.items():
            flat[f"{prefix}/pass@{kk}"] = value
        groups = {**({source: score for source, score in self.by_source.items()} if len(self.by_source) > 1 else {}),
                  **{f"task/{task}": score for task, score in self.by_task.items()}}
        for name, score in groups.items():
            flat[f"{prefix}/{name}/avg@k"] = score.avg_at_k
            flat[f"{prefix}/{name}/distinct_answers"] = score.distinct_answers
            if score.greedy_accuracy is not None:
                flat[f"{prefix}/{name}/greedy_accuracy"] = score.greedy_accuracy
        return flat

    def describe(self) -> str:
        ks = ", ".join(f"pass@{kk} {v:.1f}" for kk, v in self.overall.pass_at.items())
        lines = [f"avg@{self.k} {self.overall.avg_at_k:.1f}% ({ks}){_greedy_text(self.overall)} on "
                 f"{self.overall.num_prompts} prompts, T={self.temperature}, top-p={self.top_p}, max "
                 f"{self.max_new_tokens} new tokens"]
        named = {**({f"task {t}": v for t, v in self.by_task.items()}),
                 **(dict(sorted(self.by_source.items())) if len(self.by_source) > 1 else {})}
        for name, score in named.items():
            lines.append(f"  {name}: avg@{self.k} {score.avg_at_k:.1f}%{_greedy_text(score)} on "
                         f"{score.num_prompts} prompts")
        return "\n".join(lines)


def _greedy_text(score: SourceScore) -> str:
    greedy = "" if score.greedy_accuracy is None else f", greedy {score.greedy_accuracy:.1f}%"
    return f"{greedy}, {score.distinct_answers:.0f}% distinct answers"


@dataclass
class _Outcomes:
    """What the episodes of one evaluation ended with, per prompt id."""

    correct: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    first_answer: dict[str, str] = field(default_factory=dict)
    greedy_correct: dict[str, bool] = field(default_factory=dict)
    greedy_answer: dict[str, str] = field(default_factory=dict)
    turns: list[int] = field(default_factory=list)
    tool_calls: list[int] = field(default_factory=list)


def final_answer(text: str) -> str:
    """The answer a completion gives (boxed, "answer is", #### or the last number), else its stripped text."""
    answer = extract_answer(text)
    return answer if answer is not None else " ".join(text.split())[:200]


def _score(prompts: Sequence[Prompt], k: int, outcomes: _Outcomes, greedy: bool) -> SourceScore:
    ks = [kk for kk in (1, 2, 4, 8, 16, 32, 64) if kk <= k]
    if k not in ks:
        ks.append(k)
    n = len(prompts)
    counts = [outcomes.correct[p.id] for p in prompts]
    answers = outcomes.greedy_answer if greedy else outcomes.first_answer
    return SourceScore(
        num_prompts=n,
        avg_at_k=100.0 * sum(c / k for c in counts) / n,
        pass_at={kk: 100.0 * sum(pass_at_k(k, c, kk) for c in counts) / n for kk in ks},
        distinct_answers=100.0 * len({answers[p.id] for p in prompts}) / n,
        greedy_accuracy=100.0 * sum(outcomes.greedy_correct[p.id] for p in prompts) / n if greedy else None,
    )


GREEDY = -1
"""The sample index of a prompt's greedy decode (its RolloutKey and request id say "greedy")."""


async def evaluate(
    backend: Backend,
    episodes: TextEpisodes,
    prompts: Sequence[Prompt],
    *,
    k: int,
    params: SamplingParams,
    seed: int,
    greedy: bool = False,
    task_params: Mapping[str, SamplingParams] | None = None,
) -> EvalReport:
    """Run k episodes per prompt (seeded per sample, so a checkpoint always scores the same), and with `greedy`
    one more per prompt decoded greedily (top_k=1), all in flight together. `task_params`: a mixture's sampling
    per task (`params` for the others); the report then scores each task too."""
    if not prompts:
        raise ValueError("evaluation needs at least one prompt")
    if not isinstance(backend, EpisodeBackend):
        backend = EpisodeBackend(backend, episodes)
    by_id: dict[str, tuple[Prompt, int]] = {}
    task_params = task_params or {}
    for prompt in prompts:
        own = task_params.get(prompt.task, params)
        for sample in [*range(k), *([GREEDY] if greedy else [])]:
            rid = f"eval:{prompt.id}#{'greedy' if sample == GREEDY else sample}"
            by_id[rid] = (prompt, sample)
            sampling = replace(own, temperature=1.0, top_k=1, top_p=1.0) if sample == GREEDY else own
            backend.start(rid, prompt, replace(sampling, seed=request_seed(seed, RolloutKey(prompt.id, sample))))
    outcomes = _Outcomes()
    remaining = len(by_id)
    while remaining:
        finished = await backend.finished()
        strays = [g.request_id for g in finished if g.request_id not in by_id]
        assert not strays, f"evaluation must own the engine, but {strays[:3]} also finished"
        texts = [backend.answer_text(g) for g in finished]  # before judge, which forgets the episodes' prompts
        verdicts = await backend.judge(finished)
        for generation, text, verdict in zip(finished, texts, verdicts):
            _record(outcomes, by_id[generation.request_id], generation, final_answer(text), verdict.passed)
        remaining -= len(finished)
    sources: dict[str, list[Prompt]] = defaultdict(list)
    tasks: dict[str, list[Prompt]] = defaultdict(list)
    for prompt in prompts:
        sources[prompt.data_source].append(prompt)
        tasks[prompt.task].append(prompt)
    turns, tool_calls = outcomes.turns, outcomes.tool_calls
    return EvalReport(
        k=k,
        temperature=params.temperature,
        top_p=params.top_p,
        max_new_tokens=max(task_params.get(task, params).max_new_tokens for task in tasks),  # a mixture's largest
        overall=_score(prompts, k, outcomes, greedy),
        by_source={source: _score(members, k, outcomes, greedy) for source, members in sources.items()},
        correct={p.id: outcomes.correct[p.id] for p in prompts},
        by_task={task: _score(members, k, outcomes, greedy) for task, members in tasks.items() if task},
        mean_turns=sum(turns) / len(turns) if turns else None,
        mean_tool_calls=sum(tool_calls) / len(tool_calls) if tool_calls else None,
    )


def _record(outcomes: _Outcomes, owner: tuple[Prompt, int], generation: Generation, answer: str,
            passed: bool) -> None:
    prompt, sample = owner
    if sample == GREEDY:
        outcomes.greedy_correct[prompt.id], outcomes.greedy_answer[prompt.id] = passed, answer
        return
    outcomes.correct[prompt.id] += int(passed)
    if sample == 0:
        outcomes.first_answer[prompt.id] = answer
    if generation.episode is not None:
        outcomes.turns.append(generation.episode.turns)
        outcomes.tool_calls.append(generation.episode.tool_calls)
