"""The Ray backend's verifiers: VerifierPool actors, elastic with the queue, replaced when one dies or hangs."""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError

from flashreinforce.controller.ray_actors import VerifierActor
from flashreinforce.controller.ray_cluster import START_TIMEOUT_S, RaySettings, ready
from flashreinforce.types import Prompt, Verdict
from flashreinforce.verifiers.pool import VerifierPool

log = logging.getLogger(__name__)

_SCORE_TRIES = 3  # verifier actors in a row that may die on the same items
_GROW_DEPTH = 8  # verifier items queued per actor before another actor starts
_IDLE_S = 30.0  # a verifier actor beyond min_workers retires after this long without a deep queue


@dataclass(eq=False)
class _Verifier:
    name: str
    actor: Any
    stats: dict[str, float] = field(default_factory=dict)
    successor: _Verifier | None = None


class RayVerifiers:
    """Verifier actors, each a VerifierPool: at least max(1, min) of them, up to max as the queue deepens."""

    def __init__(self, settings: RaySettings, options: Mapping[str, Any], prefix: str) -> None:
        self.actor_class = ray.remote(VerifierActor)
        self.options, self.prefix = dict(options), prefix
        self.timeout_s, self.call_timeout_s = settings.health_timeout_s, settings.verifier_timeout_s
        self.floor, self.ceiling = max(1, settings.verifier_workers[0]), max(1, settings.verifier_workers[1])
        self._ids = itertools.count()
        self.active = [self._new() for _ in range(self.floor)]
        self._starting: asyncio.Task | None = None
        self._pending: _Verifier | None = None
        """The actor _starting waits for: not yet active, so close() must stop it by itself."""
        self._queued = 0
        self._deep_at = time.monotonic()
        self._retired: collections.Counter[str] = collections.Counter()
        """Counters of actors no longer running (replaced or retired)."""

    def _new(self) -> _Verifier:
        name = f"{self.prefix}-verifier-{next(self._ids)}"
        return _Verifier(name, self.actor_class.options(name=name, num_cpus=1, max_restarts=0).remote(
            VerifierPool, self.options))

    def wait_ready(self) -> None:
        for verifier in self.active:
            ready(verifier.actor.ping.remote(), f"verifier actor {verifier.name}")

    async def score(self, items: Sequence[tuple[str, Prompt]]) -> list[Verdict]:
        """Verdicts in order, the items dealt out in contiguous chunks, one per actor."""
        if not items:
            return []
        self._queued += len(items)
        try:
            self._grow()
            chunks = _chunks(list(items), len(self.active))
            scored = await asyncio.gather(*(self._score_on(v, chunk) for v, chunk in zip(list(self.active), chunks)))
        finally:
            self._queued -= len(items)
        self._shrink()
        return [verdict for verdicts in scored for verdict in verdicts]

    async def _score_on(self, verifier: _Verifier, items: list[tuple[str, Prompt]]) -> list[Verdict]:
        completions, prompts = [c for c, _ in items], [p for _, p in items]
        timeout_s = len(items) * self.call_timeout_s + self.timeout_s  # each call is bounded by the pool
        error: Exception | None = None
        for _ in range(_SCORE_TRIES):
            try:
                verdicts, verifier.stats = await asyncio.wait_for(verifier.actor.score.remote(completions, prompts),
                                                                  timeout_s)
                return verdicts
            except (RayActorError, asyncio.TimeoutError) as lost:
                error = lost
                verifier = self._replace(verifier, lost)
        raise RuntimeError(f"{_SCORE_TRIES} verifier actors in a row died or hung on the same {len(items)} items "
                           f"(last: {error!r}); the Ray logs (/tmp/ray/session_latest/logs) say why")

    def _replace(self, verifier: _Verifier, error: Exception) -> _Verifier:
        if verifier.successor is None:  # the first of its chunks to fail replaces it; the others follow
            log.warning("verifier actor %s lost (%r); scoring its items again on a new one", verifier.name, error)
            ray.kill(verifier.actor, no_restart=True)
            self._retired.update(verifier.stats)
            self._retired["replaced"] += 1
            verifier.successor = self._new()
            if verifier in self.active:
                self.active[self.active.index(verifier)] = verifier.successor
        return verifier.successor

    def _grow(self) -> None:
        if self._queued > _GROW_DEPTH * len(self.active):
            self._deep_at = time.monotonic()
            if self._starting is None and len(self.active) < self.ceiling:
                self._starting = asyncio.ensure_future(self._start_one())

    async def _start_one(self) -> None:
        """A new actor joins once it answers, so no items wait for its start."""
        verifier = self._pending = self._new()
        try:
            await asyncio.wait_for(verifier.actor.ping.remote(), START_TIMEOUT_S)
        except (RayActorError, asyncio.TimeoutError) as error:
            log.warning("verifier actor %s did not start (%r)", verifier.name, error)
            ray.kill(verifier.actor, no_restart=True)
        else:
            self.active.append(verifier)
        finally:
            self._starting = self._pending = None

    def _shrink(self) -> None:
        if self._queued == 0 and len(self.active) > self.floor and time.monotonic() - self._deep_at > _IDLE_S:
            verifier = self.active.pop()
            self._retired.update(verifier.stats)
            ray.kill(verifier.actor, no_restart=True)

    def stats(self) -> dict[str, float]:
        """The pools' counters summed over every actor there was, and how many run now."""
        total = collections.Counter(self._retired)
        for verifier in self.active:
            total.update(verifier.stats)
        return {**total, "actors": float(len(self.active))}

    def close(self) -> None:
        if self._starting is not None:
            self._starting.cancel()
        # Killed here, not by the cancelled start: a close() on the way out may be the event loop's last turn.
        for verifier in [*self.active, *([self._pending] if self._pending is not None else [])]:
            ray.kill(verifier.actor, no_restart=True)


def _chunks(items: list[Any], count: int) -> Iterable[list[Any]]:
    """`items` in `count` contiguous chunks of near-equal size (fewer when there are fewer items)."""
    size = -(-len(items) // max(1, count))
    return [items[i: i + size] for i in range(0, len(items), size)]
