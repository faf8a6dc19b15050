"""AHRL for a run: the warm start's pass@k per training prompt (measured once, kept in the run directory),
then the hinted prompts the loop renders."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from flashreinforce.algorithms.passk import pass_at_k
from flashreinforce.config import RunConfig
from flashreinforce.controller.backend import Backend
from flashreinforce.envs.hints import HintedPrompts
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.eval.evaluate import evaluate
from flashreinforce.metrics.console import Reporter
from flashreinforce.run.directory import read_json, write_json_atomic
from flashreinforce.run.engines import rollout_params
from flashreinforce.types import Prompt


async def build_hints(config: RunConfig, run_dir: Path, backend: Backend, episodes: TextEpisodes,
                      train: Sequence[Prompt], reporter: Reporter) -> HintedPrompts | None:
    """algo.hints as a HintedPrompts over the warm start's pass rates; None when AHRL is off."""
    hints = config.algo.hints
    if hints is None:
        return None
    rates = await initial_pass_rates(config, run_dir, backend, episodes, train, reporter)
    hinted = HintedPrompts(episodes, rates, p_initial=hints.p_initial, gamma=hints.gamma,
                           pass_threshold=hints.pass_threshold, pass_floor=hints.pass_floor,
                           think_open=hints.think_open)
    reporter.note(f"AHRL: {sum(hinted.qualifies(p) for p in train)} of {len(train)} training prompts qualify "
                  "for hints")
    return hinted


async def initial_pass_rates(config: RunConfig, run_dir: Path, backend: Backend, episodes: TextEpisodes,
                             prompts: Sequence[Prompt], reporter: Reporter) -> dict[str, float]:
    """AHRL's pass_x^initial: unbiased pass@k of the warm-start model on every training prompt with a reference
    think, from `hints.samples` samples each; measured once (before the first RL step) and kept in the run."""
    path = run_dir / "pass_initial.json"
    saved = read_json(path)
    if saved is not None:
        return saved
    hints = config.algo.hints
    candidates = [p for p in prompts if p.reference_think is not None]
    if not candidates:
        raise ValueError("algo.hints is set but no training prompt has a reference think (extra_info.reference_think)")
    with reporter.status(f"AHRL: pass@{hints.k} of the warm start on {len(candidates)} training prompts"):
        report = await evaluate(backend, episodes, candidates, k=hints.samples, params=rollout_params(config),
                                seed=config.seed + 1,
                                task_params={name: rollout_params(config.for_task(name)) for name in config.tasks or {}})
    rates = {pid: pass_at_k(hints.samples, correct, hints.k) for pid, correct in report.correct.items()}
    write_json_atomic(path, rates)
    return rates
