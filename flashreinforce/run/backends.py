"""Backends by `backend.kind`, the CPU pool they score with, and episodes by `env.kind`.

A backend builder takes the config and the run's parts (engine, trainer, pool, tokenizer) and returns a
Backend (controller/backend.py). Adding a backend or an environment is adding a builder below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flashreinforce.config import RunConfig
from flashreinforce.controller.backend import Backend
from flashreinforce.controller.local import LocalBackend
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.rollout.engine import Engine
from flashreinforce.run.engines import ENGINES
from flashreinforce.run.tables import pick_builder
from flashreinforce.verifiers.pool import VerifierPool


def build_local_backend(config: RunConfig, engine: Engine, trainer: Any, pool: VerifierPool, tokenizer: Any) -> Backend:
    """Engine thread + trainer (thread or process) + verifier processes; lockstep when deterministic."""
    return LocalBackend(engine, trainer, pool, tokenizer, overlap=not config.deterministic)


BACKENDS: dict[str, Callable[..., Backend]] = {
    "local": build_local_backend,
}

ENVS: dict[str, Callable[[Any], TextEpisodes]] = {
    "math": TextEpisodes,  # single-turn: prompt -> one completion -> the verifier's verdict
}


def build_backend(config: RunConfig, engine: Engine, trainer: Any, pool: VerifierPool, tokenizer: Any) -> Backend:
    return pick_builder(BACKENDS, "backend.kind", config.backend.kind)(config, engine, trainer, pool, tokenizer)


def build_episodes(config: RunConfig, tokenizer: Any) -> TextEpisodes:
    return pick_builder(ENVS, "env.kind", config.env.kind)(tokenizer)


def build_verifier_pool(config: RunConfig) -> VerifierPool:
    verifier = config.verifier
    return VerifierPool([verifier.reward_fn], timeout_s=verifier.timeout_s, min_workers=verifier.min_workers,
                        max_workers=verifier.max_workers, memory_limit_mb=verifier.memory_limit_mb)


def check_buildable(config: RunConfig) -> None:
    """Fail before any work when the config names a part this build has no builder for, saying so."""
    pick_builder(ENGINES, "rollout.engine", config.rollout.engine)
    pick_builder(BACKENDS, "backend.kind", config.backend.kind)
    pick_builder(ENVS, "env.kind", config.env.kind)
