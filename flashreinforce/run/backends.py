"""Backends by `backend.kind`, the CPU pool they score with, and the episodes they run (env.kind).

A backend builder takes the config and the run's parts (engine, trainer, pool, tokenizer) and returns a
Backend (controller/backend.py). Adding a backend is adding a builder below; an environment is a class named
in envs.protocol.ENV_KINDS (or a user's file), built in the env pool's workers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flashreinforce.config import RunConfig
from flashreinforce.controller.backend import Backend
from flashreinforce.controller.episodes import EpisodeBackend, EpisodeSettings
from flashreinforce.controller.local import LocalBackend
from flashreinforce.envs.pool import EnvPool
from flashreinforce.envs.protocol import EnvSpec, resolve_env_class
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.rollout.engine import Engine
from flashreinforce.run.engines import ENGINES
from flashreinforce.run.tables import pick_builder
from flashreinforce.run.tasks import renderer_for
from flashreinforce.verifiers.pool import VerifierPool


def build_local_backend(config: RunConfig, engine: Engine, trainer: Any, pool: VerifierPool, tokenizer: Any) -> Backend:
    """Engine thread + trainer (thread or process) + verifier processes; lockstep when deterministic."""
    return LocalBackend(engine, trainer, pool, tokenizer, overlap=not config.deterministic)


BACKENDS: dict[str, Callable[..., Backend]] = {
    "local": build_local_backend,
}

def build_backend(config: RunConfig, engine: Engine, trainer: Any, pool: VerifierPool, tokenizer: Any) -> Backend:
    return pick_builder(BACKENDS, "backend.kind", config.backend.kind)(config, engine, trainer, pool, tokenizer)


def build_episodes(config: RunConfig, tokenizer: Any) -> TextEpisodes:
    """Prompt rendering and decoding, the same for every env.kind: a multi-turn run's environments are built
    in its EnvPool's workers (build_env_pool), by env.kind through envs.protocol.ENV_KINDS."""
    return TextEpisodes(tokenizer)


def env_spec(config: RunConfig) -> EnvSpec:
    return EnvSpec(kind=config.env.kind, options=dict(config.env.options))


def build_env_pool(config: RunConfig) -> EnvPool | None:
    """Worker processes for a multi-turn run's environments (None for single-turn); started by the caller."""
    if not config.env.multi_turn:
        return None
    env = config.env
    return EnvPool(env_spec(config), step_timeout_s=env.step_timeout_s, min_workers=env.min_workers,
                   max_workers=max(env.min_workers, env.max_workers))


def build_episode_backend(config: RunConfig, backend: Backend, episodes: TextEpisodes, env_pool: EnvPool | None,
                          max_context: int) -> EpisodeBackend:
    """Episodes over the backend: single-turn, or multi-turn over env_pool with the config's budgets."""
    env = config.env
    renderer = renderer_for(config, episodes.tokenizer) if env_pool is not None else None
    return EpisodeBackend(backend, episodes, pool=env_pool, renderer=renderer,
                          settings=EpisodeSettings(max_turns=env.max_turns, reward=env.reward,
                                                   max_context=max_context, lockstep=config.deterministic))


def build_verifier_pool(config: RunConfig) -> VerifierPool:
    verifier = config.verifier
    return VerifierPool([verifier.reward_fn], timeout_s=verifier.timeout_s, min_workers=verifier.min_workers,
                        max_workers=verifier.max_workers, memory_limit_mb=verifier.memory_limit_mb)


def check_buildable(config: RunConfig) -> None:
    """Fail before any work when the config names a part this build has no builder for, saying so."""
    pick_builder(ENGINES, "rollout.engine", config.rollout.engine)
    pick_builder(BACKENDS, "backend.kind", config.backend.kind)
    if config.env.multi_turn:
        resolve_env_class(env_spec(config))  # an unknown kind, a missing extra or a bad user file fails now
    if config.trainer.lora is not None:
        from flashreinforce.trainer.lora import require_peft

        require_peft()  # before data, the warm start and the model load
