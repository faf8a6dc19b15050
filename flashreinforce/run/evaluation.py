"""`flashreinforce eval`: avg@k and unbiased pass@k of a saved model, per data_source, on a fresh engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from flashreinforce.config import RunConfig, config_from_tree, load_config
from flashreinforce.controller.episodes import EpisodeBackend
from flashreinforce.controller.local import LocalBackend
from flashreinforce.data.loaders import load_prompts
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.eval.evaluate import EvalReport, evaluate
from flashreinforce.models.causal_lm import model_dir_problem
from flashreinforce.run.backends import (
    build_env_pool,
    build_episode_backend,
    build_episodes,
    build_verifier_pool,
)
from flashreinforce.run.data import Data, load_data, tagged
from flashreinforce.run.directory import read_run_config
from flashreinforce.run.endpoint import build_agent_parts, start_agent_parts
from flashreinforce.run.engines import build_engine, engine_shape, model_context
from flashreinforce.run.policy import load_policy
from flashreinforce.trainer.checkpoint import latest_checkpoint
from flashreinforce.types import SamplingParams

T = TypeVar("T")


@dataclass(frozen=True)
class EvalRequest:
    """What to evaluate and how; None fields take the run's (or the recipe's) config."""

    path: Path
    """A run directory, a checkpoints/step_* directory, or a Hugging Face model directory."""
    data: Path | None = None
    recipe: str | None = None
    k: int = 4
    num_prompts: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int | None = None
    seed: int = 0
    json_path: Path | None = None
    task: str | None = None
    """The task of a run of several tasks that `data`'s rows belong to (scored and sampled as that task)."""


def resolve_model_dir(path: Path) -> tuple[Path, Path | None]:
    """(model directory, run directory or None) for a run dir, a checkpoints/step_* dir or a model dir. A
    pipeline's run directory gives its newest stage that has a model (each stage's own directory is a run's)."""
    stages = sorted((path / "stages").glob("[0-9][0-9]-*"), reverse=True)
    done = [stage for stage in stages if latest_checkpoint(stage / "checkpoints") or (stage / "sft").is_dir()]
    if (path / "config.yaml").is_file() and done:
        return resolve_model_dir(done[0])
    if (path / "config.yaml").is_file():  # a run directory: its latest checkpoint, else its warm start
        checkpoint = latest_checkpoint(path / "checkpoints")
        model_dir = checkpoint / "model" if checkpoint is not None else path / "sft"
        return model_dir, path
    if (path / "model" / "config.json").is_file():  # checkpoints/step_N
        run_dir = path.parent.parent
        return path / "model", run_dir if (run_dir / "config.yaml").is_file() else None
    if (path / "config.json").is_file():
        run_dir = path.parent
        return path, run_dir if (run_dir / "config.yaml").is_file() else None
    raise ValueError(f"{path} is not a run directory, a checkpoint directory or a Hugging Face model directory")


def evaluate_checkpoint(request: EvalRequest) -> dict:
    """Score the model `request.path` names; prints one line and returns the report as a dict."""
    model_dir, run_dir = resolve_model_dir(Path(request.path))
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} holds no model yet (the run has no checkpoint and no warm start)")
    problem = model_dir_problem(model_dir)  # checked before the tokenizer: a damaged file is named, not a traceback
    if problem is not None:
        raise ValueError(f"cannot evaluate {model_dir}: {problem[0].name} {problem[1]}; restore it from a backup, "
                         "or evaluate an older checkpoint (pass its checkpoints/step_* directory)")
    config = config_from_tree(read_run_config(run_dir)) if run_dir is not None else load_config(request.recipe)
    config = with_budget(config, request.max_new_tokens)
    data = eval_data(config, request)
    report = score_prompts(config, model_dir, data, k=request.k, temperature=request.temperature,
                           top_p=request.top_p, seed=request.seed)
    print(f"{model_dir}: {report.describe()}")
    result = {"model": str(model_dir), **report.metrics(), "k": request.k, "num_prompts": len(data.eval),
              "temperature": request.temperature, "top_p": request.top_p,
              "max_new_tokens": max(task.rollout.max_new_tokens
                                    for task in (config.for_task(name) for name, _ in config.task_list()))}
    if request.json_path is not None:
        request.json_path.write_text(json.dumps(result, indent=2))
    return result


def score_prompts(config: RunConfig, model_dir: Path, data: Data, *, k: int, temperature: float = 1.0,
                  top_p: float = 1.0, seed: int = 0) -> EvalReport:
    """`k` samples of the model at `model_dir` on each of `data.eval` (each task's own sampling budget and stop
    strings, the run's environments and verifiers) on a fresh engine: the report keeps each prompt's count of
    correct samples, so a caller can follow any subset of prompts across checkpoints."""
    params = {name: SamplingParams(max_new_tokens=task.rollout.max_new_tokens, temperature=temperature,
                                   top_p=top_p, stop_strings=tuple(task.env.stop_strings))
              for name, task in ((name, config.for_task(name)) for name, _ in config.task_list())}

    async def job(backend: EpisodeBackend, episodes: TextEpisodes) -> EvalReport:
        return await evaluate(backend, episodes, data.eval, k=k, params=next(iter(params.values())), seed=seed,
                              greedy=config.eval.greedy, task_params=params)

    return asyncio.run(on_fresh_backend(config, model_dir, data, seed, job))


async def on_fresh_backend(config: RunConfig, model_dir: Path, data: Data, seed: int,
                           job: Callable[[EpisodeBackend, TextEpisodes], Awaitable[T]]) -> T:
    """job(backend, episodes) on an engine of its own over the model at `model_dir`, with the run's environments,
    agents (and their endpoint) and verifiers (no trainer), closed after it whatever happens."""
    policy = load_policy(model_dir)
    episodes = build_episodes(config, policy.tokenizer, policy.model)
    shape = engine_shape(config, episodes, data, model_context(policy.model), version=0, seed=seed)
    engine = build_engine(config, policy, shape)
    with build_verifier_pool(config) as pool:
        env_pool = build_env_pool(config)
        inner = LocalBackend(engine, None, pool, policy.tokenizer, overlap=False)
        stack = contextlib.AsyncExitStack()
        agents = build_agent_parts(config, policy.tokenizer, shape.context, stack)
        backend = build_episode_backend(config, inner, episodes, env_pool, shape.context,
                                        agents[0] if agents is not None else None)
        try:
            if env_pool is not None:
                await env_pool.start()
            await start_agent_parts(agents, None)
            return await job(backend, episodes)
        finally:
            await backend.close()
            await stack.aclose()
            if env_pool is not None:
                await env_pool.aclose()


def with_budget(config: RunConfig, max_new_tokens: int | None) -> RunConfig:
    """The config with every task's response budget set to `max_new_tokens` (None: as the config has them)."""
    if max_new_tokens is None:
        return config
    rollout = config.rollout.model_copy(update={"max_new_tokens": max_new_tokens})
    tasks = {name: task.model_copy(update={"rollout": task.rollout.model_copy(update={"max_new_tokens": max_new_tokens})})
             for name, task in (config.tasks or {}).items()} or None
    return config.model_copy(update={"rollout": rollout, "tasks": tasks})


def eval_data(config: RunConfig, request: EvalRequest) -> Data:
    """The prompts to score: the first num_prompts of the run's held-out set (of each task's, in a mixture), or of
    request.data's file, whose rows, in a mixture, belong to request.task."""
    count = request.num_prompts or config.eval.num_prompts
    if request.data is None:
        data = load_data(config)
        by_task = {name: ([], held_out[:count]) for name, (_, held_out) in data.by_task.items()}
        return Data([], [p for _, held_out in by_task.values() for p in held_out] or data.eval[:count], 0, by_task)
    prompts = load_prompts(request.data).prompts[:count]
    if config.tasks is None:
        return Data([], prompts, 0)
    if request.task not in config.tasks:
        raise ValueError(f"--data with a run of several tasks: name the task its rows belong to with --task (one "
                         f"of {', '.join(config.tasks)}); got {request.task!r}")
    task = config.tasks[request.task]
    prompts = [tagged(p, task=request.task, modality=task.modality) for p in prompts]
    return Data([], prompts, 0, {name: ([], prompts if name == request.task else []) for name in config.tasks})