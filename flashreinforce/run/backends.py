"""Backends by `backend.kind`, the CPU pool they score with, and the episodes they run (env.kind).

A backend opener takes the config, the starting policy and the engines' shape, builds the engine, trainer and
verifier pool where that backend keeps them (here for local, in Ray actors for ray) and returns them as an
OpenedBackend; the AsyncExitStack it is given closes what it opened. Adding a backend is adding an opener
below; an environment is a class named in envs.protocol.ENV_KINDS (or a user's file), built in the env pool's
workers.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flashreinforce.algorithms.losses import LOSSES
from flashreinforce.config import RunConfig
from flashreinforce.controller.backend import Backend
from flashreinforce.controller.episodes import AgentParts, EpisodeBackend, EpisodeSettings, TaskRoute
from flashreinforce.controller.local import LocalBackend
from flashreinforce.envs.pool import EnvPool, ProcessWorker, WorkerLink
from flashreinforce.envs.protocol import EnvSpec, resolve_env_class
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.rollout.engine import Engine
from flashreinforce.rollout.vllm_engine import SETUP_HINT
from flashreinforce.run.data import Data
from flashreinforce.run.endpoint import check_endpoint
from flashreinforce.run.engines import ENGINES, EngineShape, build_engine
from flashreinforce.run.learner import build_rank_trainer, build_trainer, start_trainer
from flashreinforce.run.policy import Policy
from flashreinforce.run.tables import pick_builder
from flashreinforce.run.tasks import renderer_for
from flashreinforce.trainer.distributed import RankGroup
from flashreinforce.trainer.trainer import Trainer
from flashreinforce.verifiers.pool import VerifierPool
from flashreinforce.verifiers.registry import check_rows, parse_spec, spec_ref

if TYPE_CHECKING:
    from flashreinforce.controller.ray_cluster import RaySettings


@dataclass(frozen=True)
class OpenedBackend:
    """A backend and the handles a run keeps beside it."""

    backend: Backend
    trainer: Any
    """Its trainer, or a handle with the trainer's face: version, state_dict, load_state_dict, close."""
    pool: Any
    """Its verifier pool, or a handle whose stats() sums the pools (the summary reports them)."""
    env_workers: Callable[[], WorkerLink] = ProcessWorker
    """How a multi-turn run's EnvPool starts a worker where this backend keeps them (build_env_pool)."""


def build_local_backend(config: RunConfig, engine: Engine, trainer: Any, pool: VerifierPool, tokenizer: Any) -> Backend:
    """Engine thread + trainer (thread or process) + verifier processes; lockstep when deterministic."""
    return LocalBackend(engine, trainer, pool, tokenizer, overlap=not config.deterministic)


def open_local_backend(config: RunConfig, policy: Policy, shape: EngineShape,
                       stack: contextlib.AsyncExitStack) -> OpenedBackend:
    """Everything in this process. The engine copies the model first: the trainer casts it in place."""
    engine = build_engine(config, policy, shape)
    pool = stack.enter_context(build_verifier_pool(config))
    trainer = start_trainer(config, policy)
    stack.callback(trainer.close)
    return OpenedBackend(build_local_backend(config, engine, trainer, pool, policy.tokenizer), trainer, pool)


def open_ray_backend(config: RunConfig, policy: Policy, shape: EngineShape,
                     stack: contextlib.AsyncExitStack) -> OpenedBackend:
    """Engines, trainer ranks, verifier pools and environment workers in Ray actors (controller/ray_backend.py,
    ray_envs.py), built there by the factories passed here; this process only keeps the books."""
    from flashreinforce.controller import ray_backend, ray_envs  # the ray extra: imported only when chosen

    settings = ray_settings(config)
    stack.callback(ray_backend.start_ray(settings))
    parts = ray_backend.RayParts(build_engine=build_engine, build_trainer=build_ray_trainer,
                                 verifier_options=verifier_options(config, workers=1), config=config, policy=policy,
                                 shape=shape)
    backend = ray_backend.start_ray_backend(settings, parts)
    stack.push_async_callback(backend.close)
    return OpenedBackend(backend, backend.trainer, backend.verifiers, env_workers=ray_envs.RayEnvWorkers())


def ray_settings(config: RunConfig) -> RaySettings:
    """The Ray backend's flat settings, as configured: a device or weight_sync left at auto is resolved against
    the cluster's GPUs once Ray is up (ray_cluster.resolve_devices, in ray_backend.start_ray_backend)."""
    from flashreinforce.controller.ray_cluster import RaySettings

    backend, trainer, verifier = config.backend, config.trainer, config.verifier
    return RaySettings(address=backend.address, num_engines=backend.num_engines,
                       engine_slots=config.rollout.max_batch_size, world_size=trainer.world_size,
                       sharded_trainer=trainer.sharding == "fsdp" and trainer.world_size > 1,
                       rollout_device=config.rollout.device, trainer_device=trainer.device,
                       weight_sync=backend.weight_sync, verifier_workers=(verifier.min_workers, verifier.max_workers),
                       env_workers=max((max(t.env.min_workers, t.env.max_workers) for _, t in config.task_list()
                                        if t.env.multi_turn), default=0),
                       verifier_timeout_s=verifier.timeout_s, health_timeout_s=backend.health_timeout_s,
                       step_timeout_s=backend.step_timeout_s, torch_threads=backend.torch_threads,
                       adapter_pushes=trainer.lora is not None and trainer.lora.push == "adapter")


def build_ray_trainer(config: RunConfig, policy: Policy, group: RankGroup | None) -> Trainer:
    """A Ray trainer actor's Trainer: the whole trainer when it is the only rank, else its data-parallel rank."""
    if group is None:
        return build_trainer(config, policy.model, policy.tokenizer)
    return build_rank_trainer(config, policy.model, policy.tokenizer, group)


BACKENDS: dict[str, Callable[[RunConfig, Policy, EngineShape, contextlib.AsyncExitStack], OpenedBackend]] = {
    "local": open_local_backend,
    "ray": open_ray_backend,
}


def open_backend(config: RunConfig, policy: Policy, shape: EngineShape,
                 stack: contextlib.AsyncExitStack) -> OpenedBackend:
    return pick_builder(BACKENDS, "backend.kind", config.backend.kind)(config, policy, shape, stack)


def build_episodes(config: RunConfig, tokenizer: Any, model: Any = None) -> TextEpisodes:
    """Prompt rendering and decoding, the same for every env.kind: a multi-turn run's environments are built
    in its EnvPool's workers (build_env_pool), by env.kind through envs.protocol.ENV_KINDS. `model`: the policy,
    whose image placeholders (a model that reads images) prompts' images expand to."""
    return TextEpisodes(tokenizer, getattr(model, "placeholders", None))


def env_specs(config: RunConfig) -> dict[str, EnvSpec]:
    """Each multi-turn task's environment, by task name ("" for a one-task run's)."""
    return {name: EnvSpec(kind=task.env.kind, options=dict(task.env.options))
            for name, task in config.task_list() if task.env.multi_turn and not task.env.through_endpoint}


def build_env_pool(config: RunConfig, start_worker: Callable[[], WorkerLink] = ProcessWorker) -> EnvPool | None:
    """The workers of a run's environments (None when every task is single-turn); started by the caller. Each
    worker holds every task's kind; in a mixture the pool takes the largest deadline and worker counts of the
    tasks' env sections. start_worker: an OpenedBackend's env_workers (processes here, or Ray actors)."""
    specs = env_specs(config)
    if not specs:
        return None
    envs = [task.env for name, task in config.task_list() if name in specs]
    return EnvPool(specs, step_timeout_s=max(e.step_timeout_s for e in envs),
                   min_workers=max(e.min_workers for e in envs),
                   max_workers=max(max(e.min_workers, e.max_workers) for e in envs), start_worker=start_worker)


def build_episode_backend(config: RunConfig, backend: Backend, episodes: TextEpisodes, env_pool: EnvPool | None,
                          max_context: int, agents: AgentParts | None = None) -> EpisodeBackend:
    """Episodes over the backend, each task's single-turn, over env_pool with its own turn budget, reward and
    observation rendering, or its agent's through the endpoint (`agents`, run/endpoint.py)."""
    routes = {name: TaskRoute(renderer_for(config.for_task(name), episodes.tokenizer, episodes.images)
                              if task.env.multi_turn and not task.env.through_endpoint else None, task.env.max_turns,
                              task.env.reward, agent=task.env.through_endpoint)
              for name, task in config.task_list()}
    return EpisodeBackend(backend, episodes, pool=env_pool, tasks=routes, agents=agents,
                          settings=EpisodeSettings(max_context=max_context, lockstep=config.deterministic))


def build_verifier_pool(config: RunConfig) -> VerifierPool:
    return VerifierPool(**verifier_options(config))


def verifier_options(config: RunConfig, *, workers: int | None = None) -> dict[str, Any]:
    """VerifierPool's arguments from verifier.*, with every task's verifier (routed by the prompt's task);
    `workers` fixes its size (a Ray verifier actor's pool)."""
    verifier = config.verifier
    low, high = (verifier.min_workers, verifier.max_workers) if workers is None else (workers, workers)
    task_refs = {name: verifier_reference(task.verifier) for name, task in config.task_list()}
    return {"reward_fns": list(dict.fromkeys(task_refs.values())), "task_refs": task_refs,
            "timeout_s": verifier.timeout_s, "min_workers": low, "max_workers": high,
            "memory_limit_mb": verifier.memory_limit_mb}


def check_verifiers(config: RunConfig, data: Data) -> None:
    """Before any work: each task's rows reach its verifier and carry ground truths it can read (registry
    check_rows); a user function is checked when the pool loads it, an environment's reward needs none."""
    for name, task in config.task_list():
        if (task.env.multi_turn and task.env.reward == "env") or (isinstance(task.verifier, str) and ":" in task.verifier):
            continue
        prompts = [*data.by_task[name][0], *data.by_task[name][1]] if data.by_task else [*data.train, *data.eval]
        field = f"tasks.{name}.verifier" if name else "verifier.reward_fn"
        check_rows(parse_spec(task.verifier, field=field), prompts, field=field)


def verifier_reference(value: str | dict[str, Any]) -> str:
    """A config's verifier as the pool's reference string: a user function's "file.py:fn" as it is, a
    registered verifier's spec by name or as JSON (verifiers/registry.py)."""
    if isinstance(value, str) and ":" in value:
        return value
    return spec_ref(parse_spec(value))


def check_buildable(config: RunConfig) -> None:
    """Fail before any work when the config names a part this build has no builder for, or options its loss
    does not take, saying so."""
    LOSSES[config.algo.loss].check_options(config.algo.options, config.algo.loss)
    pick_builder(ENGINES, "rollout.engine", config.rollout.engine)
    pick_builder(BACKENDS, "backend.kind", config.backend.kind)
    if config.backend.kind == "ray":
        check_ray(config)
    if config.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:  # before the model loads
        raise ValueError(f"rollout.engine=vllm needs vLLM, which this Python cannot import: {SETUP_HINT}")
    for spec in env_specs(config).values():
        resolve_env_class(spec)  # an unknown kind, a missing extra or a bad user file fails now
    check_endpoint(config)
    if config.trainer.lora is not None:
        from flashreinforce.trainer.lora import require_peft

        require_peft()  # before data, the warm start and the model load


def check_ray(config: RunConfig) -> None:
    """backend.kind=ray needs the ray extra and the overlapped loop."""
    if importlib.util.find_spec("ray") is None:
        raise ValueError("backend.kind=ray needs the ray extra: pip install -e '.[ray]' (or set backend.kind=local)")
    if config.deterministic:
        raise ValueError("backend.kind=ray runs the overlapped loop only; deterministic=true (lockstep, bitwise "
                         "reproducible) needs backend.kind=local")
