"""Held-out evaluation reports greedy accuracy and distinct answers, so a collapsed policy cannot hide behind avg@k."""

from __future__ import annotations

import asyncio

from scripted_backend import FinishedQueue

from flashreinforce.controller.episodes import EpisodeBackend, TaskRoute
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.eval.evaluate import evaluate, final_answer
from flashreinforce.models import build_char_tokenizer
from flashreinforce.types import Generation, Prompt, SamplingParams, Verdict

TOKENIZER = build_char_tokenizer("0123456789 answerix=+")
EOS = TOKENIZER.eos_token_id


class CollapsedBackend(FinishedQueue):
    """Greedy (top_k=1) always answers "2"; a sampled request answers the ground truth on odd seeds, else "2"."""

    def __init__(self, truths: dict[tuple[int, ...], str]) -> None:
        super().__init__()
        self.truths, self.submitted = truths, []

    free_slots = 64

    @property
    def in_flight(self) -> int:
        return len(self.done)

    def submit(self, rid, prompt_ids, params, prefix=None):
        self.submitted.append((rid, params))
        truth = self.truths[tuple(prompt_ids)]
        answer = "2" if params.top_k == 1 or params.seed % 2 == 0 else truth
        ids = (*TOKENIZER.encode(f"answer is {answer}", add_special_tokens=False), EOS)
        n = len(ids)
        self.finish(Generation(rid, tuple(prompt_ids), ids, (-0.1,) * n, (0,) * n, (1,) * n, "stop", params))

    async def score(self, items):
        return [Verdict(float(final_answer(text) == p.ground_truth), final_answer(text) == p.ground_truth)
                for text, p in items]


def _run(greedy: bool):
    prompts = [Prompt(f"p{i}", f"{i}+x=", str(i), data_source="even" if i % 2 == 0 else "odd") for i in range(8)]
    episodes = TextEpisodes(TOKENIZER)
    backend = CollapsedBackend({tuple(episodes.prompt_ids(p)): p.ground_truth for p in prompts})
    report = asyncio.run(evaluate(EpisodeBackend(backend, episodes), episodes, prompts, k=4,
                                  params=SamplingParams(max_new_tokens=16), seed=0, greedy=greedy))
    return report, backend


def test_greedy_accuracy_and_distinct_answers_expose_a_collapse():
    report, backend = _run(greedy=True)
    greedy = [params for rid, params in backend.submitted if rid.endswith("#greedy")]
    assert len(greedy) == 8 and all(p.top_k == 1 for p in greedy)
    metrics = report.metrics()
    assert metrics["eval/greedy_accuracy"] == 100.0 / 8  # only the prompt whose answer is 2 ("p2")
    assert metrics["eval/distinct_answers"] == 100.0 / 8  # every greedy answer is "2"
    assert 0 < metrics["eval/avg@k"] < 100  # sampling still looks partly right
    assert metrics["eval/even/greedy_accuracy"] == 25.0 and metrics["eval/odd/greedy_accuracy"] == 0.0
    assert "greedy 12.5%" in report.describe()
    # Greedy decodes do not count towards avg@k / pass@k: 4 samples per prompt, not 5.
    assert sum(report.correct.values()) <= 8 * 4


def test_without_greedy_nothing_extra_runs_and_distinct_answers_use_the_first_samples():
    report, backend = _run(greedy=False)
    assert not any(rid.endswith("#greedy") for rid, _ in backend.submitted) and len(backend.submitted) == 32
    assert report.overall.greedy_accuracy is None and "eval/greedy_accuracy" not in report.metrics()
    assert 0 < report.overall.distinct_answers <= 100


def test_a_mixture_samples_each_task_with_its_own_budget_and_reports_the_largest():
    prompts = [Prompt(f"{task}/p{i}", f"{i}+x=", str(i), task=task) for task in ("short", "long") for i in range(2)]
    episodes = TextEpisodes(TOKENIZER)
    backend = CollapsedBackend({tuple(episodes.prompt_ids(p)): p.ground_truth for p in prompts})
    budgets = {"short": SamplingParams(max_new_tokens=16), "long": SamplingParams(max_new_tokens=400)}
    routed = EpisodeBackend(backend, episodes, tasks={"short": TaskRoute(), "long": TaskRoute()})
    report = asyncio.run(evaluate(routed, episodes, prompts, k=2, params=budgets["short"], seed=0,
                                  task_params=budgets))
    used = {rid.split(":")[1].split("/")[0]: params.max_new_tokens for rid, params in backend.submitted}
    assert used == {"short": 16, "long": 400}
    assert report.max_new_tokens == 400 and "max 400 new tokens" in report.describe()
    assert set(report.by_task) == {"short", "long"}


def test_final_answer_takes_the_extracted_answer_else_the_text():
    assert final_answer("so the answer is 42.") == "42"
    assert final_answer("#### 17") == "17"
    assert final_answer("  go   north ") == "go north"
