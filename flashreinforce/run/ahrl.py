"""AHRL for a run: the warm start's pass@k per training prompt (measured once, kept in the run directory),
then the hinted prompts the loop renders.

In a pipeline, eq. 5's pass_initial is the SFT model's (the latest sft stage's, else the pipeline's start) and
its t counts the hinted stage's own steps, so a hinted stage that follows an RL stage anneals as it would right
after SFT: measured on the SFT weights by an engine of its own, the stage's weights untouched."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from flashreinforce.algorithms.passk import pass_at_k
from flashreinforce.config import RunConfig
from flashreinforce.controller.backend import Backend
from flashreinforce.envs.hints import HintedPrompts
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.eval.evaluate import EvalReport, evaluate
from flashreinforce.metrics.console import Reporter
from flashreinforce.run.directory import read_json, write_json_atomic
from flashreinforce.run.data import Data
from flashreinforce.run.engines import rollout_params
from flashreinforce.run.evaluation import on_fresh_backend
from flashreinforce.run.policy import resolve_model_path
from flashreinforce.run.stages import StageStart, first_step
from flashreinforce.types import Prompt


async def build_hints(config: RunConfig, run_dir: Path, backend: Backend, episodes: TextEpisodes,
                      train: Sequence[Prompt], reporter: Reporter, stage: StageStart | None = None
                      ) -> HintedPrompts | None:
    """algo.hints as a HintedPrompts over the warm start's pass rates; None when AHRL is off. In a pipeline's stage
    its steps count from the stage's first, and the pass rates are the SFT model's."""
    hints = config.algo.hints
    if hints is None:
        return None
    warm = warm_model(config, stage)
    rates = await initial_pass_rates(config, run_dir, backend, episodes, train, reporter, warm)
    hinted = HintedPrompts(episodes, rates, p_initial=hints.p_initial, gamma=hints.gamma,
                           pass_threshold=hints.pass_threshold, pass_floor=hints.pass_floor,
                           think_open=hints.think_open, first_step=first_step(stage))
    reporter.note(f"AHRL: {sum(hinted.qualifies(p) for p in train)} of {len(train)} training prompts qualify "
                  "for hints")
    return hinted


def warm_model(config: RunConfig, stage: StageStart | None) -> Path | None:
    """Where pass_initial must be measured when it is not the run's own starting weights: the SFT model of a
    pipeline whose hinted stage starts from an RL stage's weights (None: the starting weights are the SFT's)."""
    if stage is None or stage.model_dir == stage.warm_model_dir or stage.model_dir is None:
        return None
    return stage.warm_model_dir or resolve_model_path(config.model.path)


async def initial_pass_rates(config: RunConfig, run_dir: Path, backend: Backend, episodes: TextEpisodes,
                             prompts: Sequence[Prompt], reporter: Reporter, warm: Path | None = None
                             ) -> dict[str, float]:
    """AHRL's pass_x^initial: unbiased pass@k of the warm-start model on every training prompt with a reference
    think, from `hints.samples` samples each; measured once (before the first RL step) and kept in the run. On
    the run's own engine before any step, or with `warm` on an engine of its own over that model."""
    path = run_dir / "pass_initial.json"
    saved = read_json(path)
    if saved is not None:
        return saved
    hints = config.algo.hints
    candidates = [p for p in prompts if p.reference_think is not None]
    if not candidates:
        raise ValueError("algo.hints is set but no training prompt has a reference think (extra_info.reference_think)")
    async def job(backend: Backend, episodes: TextEpisodes) -> EvalReport:
        return await evaluate(backend, episodes, candidates, k=hints.samples, params=rollout_params(config),
                              seed=config.seed + 1,
                              task_params={name: rollout_params(config.for_task(name)) for name in config.tasks or {}})

    where = "the warm start" if warm is None else str(warm)
    with reporter.status(f"AHRL: pass@{hints.k} of {where} on {len(candidates)} training prompts"):
        if warm is None:
            report = await job(backend, episodes)
        else:
            by_task = {name: ([p for p in candidates if p.task == name], []) for name in config.tasks or {}}
            report = await on_fresh_backend(config, warm, Data(candidates, [], 0, by_task), config.seed + 1, job)
    rates = {pid: pass_at_k(hints.samples, correct, hints.k) for pid, correct in report.correct.items()}
    write_json_atomic(path, rates)
    return rates
