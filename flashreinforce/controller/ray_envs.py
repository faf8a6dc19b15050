"""Environment workers as Ray actors: the EnvPool's workers (envs/pool.py) under backend.kind=ray.

The pool keeps every episode's books in the driver (prompt, seed, actions so far, deadlines, growth up to
env.max_workers); each worker is an actor serving envs/worker.py's sessions, on whichever node Ray places it.
A call that overruns env.step_timeout_s kills its actor (ray.kill ends a step that never returns, as killpg does
for a worker process). An actor that dies (killed, out of memory, its node lost) is replaced as a worker process
would be: the call that found it dead runs once more on another worker, and its sessions replay there from their
seeded resets, so nothing an episode did is lost; a call that kills its worker again ends its episode
("env_crash"). The pool starts new actors itself, so Ray never restarts one (max_restarts=0).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import uuid
from typing import Any

import ray
from ray.exceptions import RayActorError

from flashreinforce.controller.ray_cluster import brief
from flashreinforce.envs.pool import WorkerLost
from flashreinforce.envs.worker import EnvSessions, EnvSpecs, check_env


class EnvWorkerActor:
    """One worker's sessions in a Ray actor (synchronous: one call at a time, in the order they were sent)."""

    def __init__(self) -> None:
        self.sessions: EnvSessions | None = None

    def start(self, sys_path: list[str], specs: EnvSpecs) -> tuple[str, str | None]:
        # The driver's import paths this process lacks: a user's environment module next to their recipe.
        sys.path.extend(path for path in sys_path if path not in sys.path)
        verdict = check_env(specs)
        if verdict[0] == "ready":
            self.sessions = EnvSessions(specs)
        return verdict

    def handle(self, message: tuple) -> tuple[str, object] | None:
        assert self.sessions is not None, "start() first"
        return self.sessions.handle(message)


class RayEnvWorkers:
    """Starts env worker actors for one run, named `flashreinforce-<run>-env-<n>`: an EnvPool's start_worker."""

    def __init__(self) -> None:
        self.actor_class = ray.remote(EnvWorkerActor)
        self.prefix = f"flashreinforce-{uuid.uuid4().hex[:8]}-env"
        self._ids = itertools.count()

    def __call__(self) -> RayEnvWorker:
        name = f"{self.prefix}-{next(self._ids)}"
        return RayEnvWorker(name, self.actor_class.options(name=name, num_cpus=1, max_restarts=0).remote())


class RayEnvWorker:
    """An env worker actor as the pool's WorkerLink."""

    def __init__(self, name: str, actor: Any) -> None:
        self.name, self.actor = name, actor

    async def start(self, specs: EnvSpecs, timeout: float) -> tuple[str, Any]:
        return await self._answer(self.actor.start.remote(list(sys.path), specs), timeout)

    async def call(self, message: tuple, timeout: float) -> tuple[str, Any]:
        return await self._answer(self.actor.handle.remote(message), timeout)

    def send(self, message: tuple) -> None:
        self.actor.handle.remote(message)  # answered with None; the actor runs it before any later call

    def stop(self) -> None:
        ray.kill(self.actor, no_restart=True)

    async def _answer(self, ref: Any, timeout: float) -> Any:
        try:
            return await asyncio.wait_for(ref, timeout)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            self.stop()
            raise WorkerLost("env_timeout") from None
        except RayActorError as error:
            self.stop()
            raise WorkerLost(f"env_crash: Ray actor {self.name} died ({brief(error)})") from None

