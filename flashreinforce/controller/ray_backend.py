"""The Ray backend: the Backend protocol (controller/backend.py) over engine, trainer and verifier actors
(the engines here; the trainer ranks in ray_trainer.py, the verifiers in ray_verifiers.py, the settings and the
cluster in ray_cluster.py).

    this process (the driver): the RL loop, scheduler and ledger, episodes, checkpoints, metrics
    engine actors (backend.num_engines): an Engine decoding in a thread; requests go to the least loaded one
    trainer actors (trainer.world_size): data-parallel ranks; rank 0's metrics and weights are the group's
    verifier actors (verifier.min_workers..max_workers, more as the queue deepens): a VerifierPool each
    environment worker actors (env.min_workers..max_workers, multi-turn runs): the driver's EnvPool's workers,
        started by it (controller/ray_envs.py), not by this module

Every remote call has a deadline (backend.health_timeout_s; an optimizer step backend.step_timeout_s): nothing
is waited on forever. The driver keeps what it submitted to each engine, and takes a finished generation only
from the engine that owns its request now. An engine that dies or stops answering is restarted (Ray runs its
constructor again), loads the current weights and version before it takes work, and its requests go to a live
engine again from the prefix they were submitted with: none is lost or delivered twice. A dead verifier actor
is replaced and its items scored again. A dead trainer rank ends the run with an error that says how to resume.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayError

from flashreinforce.controller.ray_actors import EngineActor, EngineReport, Submission
from flashreinforce.controller.ray_cluster import (START_TIMEOUT_S, RaySettings, brief, ready, resolve_devices,
                                                   start_ray)
from flashreinforce.controller.ray_trainer import RayTrainer
from flashreinforce.controller.ray_verifiers import RayVerifiers
from flashreinforce.controller.ray_weights import WeightBroadcaster
from flashreinforce.rollout.engine import EngineStats
from flashreinforce.types import Generation, Prompt, SamplingParams, Trajectory, Verdict

__all__ = ["RayBackend", "RayParts", "RaySettings", "start_ray", "start_ray_backend"]  # the last two: ray_cluster

log = logging.getLogger(__name__)

_POLL_S = 1.0  # how long an engine holds a poll open while nothing finishes
_RECOVERY_TRIES = 3  # restarts in a row that may fail before an engine is given up (and the run with it)
_FROM_TRAINER = object()
"""In RayBackend._weights: the last push went by broadcast, so nothing in the object store holds it, or it carried
a LoRA adapter alone; an engine that restarts loads rank 0's versioned weights instead (RayTrainer.versioned_weights,
with the base)."""


@dataclass(frozen=True)
class RayParts:
    """What the actors build, by factories of the run layer (the controller does not import it)."""

    build_engine: Callable[..., Any]
    """(config, policy, shape) -> Engine, in each engine actor."""
    build_trainer: Callable[..., Any]
    """(config, policy, RankGroup | None) -> Trainer, in each trainer actor."""
    verifier_options: Mapping[str, Any]
    """VerifierPool(**verifier_options) is one verifier actor's pool."""
    config: Any
    policy: Any
    """The starting policy; its tokenizer is saved beside every checkpoint's model."""
    shape: Any
    """The engines' EngineShape; its version is the policy's."""


def start_ray_backend(settings: RaySettings, parts: RayParts) -> RayBackend:
    """Start every actor (on the Ray this process is connected to) and wait until each has answered. Devices and
    weight_sync left at auto are resolved here, against the GPUs of that cluster."""
    settings = resolve_devices(settings, ray.cluster_resources())
    prefix = f"flashreinforce-{uuid.uuid4().hex[:8]}"  # actor names: ray.get_actor(f"{prefix}-engine-0")
    # The model goes into the object store once, for every actor. Ray warns at each engine's start that a
    # restart fails if that object is lost (ray#53727): the backend holds the ref for as long as they live.
    config, policy = parts.config, ray.put(parts.policy)
    engine_class = ray.remote(EngineActor)
    engines = []
    for name in (f"{prefix}-engine-{i}" for i in range(settings.num_engines)):
        actor = engine_class.options(**settings.actor_options("engine", name)).remote(
            settings.torch_threads, parts.build_engine, config, policy, parts.shape)
        engines.append(_Engine(name, actor))
    verifiers = RayVerifiers(settings, parts.verifier_options, prefix)
    trainer: RayTrainer | None = None
    try:
        trainer = RayTrainer.start(settings, parts.build_trainer, config, policy, prefix)
        for engine in engines:
            ready(engine.actor.ping.remote(), f"engine actor {engine.name}")
        verifiers.wait_ready()
    except BaseException:
        for handle in [e.actor for e in engines]:
            ray.kill(handle, no_restart=True)
        verifiers.close()
        if trainer is not None:
            trainer.close()
        raise
    return RayBackend(settings, engines, trainer, verifiers, policy, parts.policy.tokenizer, parts.shape.version)


class EngineLost(Exception):
    """An engine actor died, or did not answer a call by its deadline."""

    def __init__(self, message: str, *, hung: bool) -> None:
        super().__init__(message)
        self.hung = hung


@dataclass(eq=False)
class _Engine:
    """One engine actor as the driver sees it."""

    name: str
    actor: Any
    requests: dict[str, Submission] = field(default_factory=dict)
    """Submitted to it and not handed back: the requests it owns."""
    submits: list[Any] = field(default_factory=list)
    """Refs of submit calls not yet confirmed (a pause or abort waits for them first)."""
    poll: asyncio.Task | None = None
    recovery: asyncio.Task | None = None
    """Set while the actor restarts and reloads the weights: it takes no work until then."""
    stats: EngineStats = EngineStats()  # noqa: RUF009 - frozen: instances share it until they replace it
    carried: EngineStats = EngineStats()  # noqa: RUF009
    """Counters of its earlier incarnations (a restart starts the engine's own from zero)."""
    version: int = 0

    @property
    def healthy(self) -> bool:
        return self.recovery is None


def _plus(a: EngineStats, b: EngineStats) -> EngineStats:
    return EngineStats(*(getattr(a, f.name) + getattr(b, f.name) for f in fields(EngineStats)))


def _as_partial(request: Submission) -> Generation:
    """What a request is known to hold when its engine cannot say: the prefix it was submitted with."""
    if request.prefix is not None:
        return request.prefix
    policy = () if request.params.return_policy_logprobs else None
    return Generation(request.request_id, request.prompt_ids, (), (), (), (), "abort", request.params,
                      policy_logprobs=policy)


class RayBackend:
    """Backend (controller/backend.py) over Ray actors; build it with start_ray_backend."""

    def __init__(self, settings: RaySettings, engines: list[_Engine], trainer: RayTrainer, verifiers: RayVerifiers,
                 policy: Any, tokenizer: Any, version: int) -> None:
        self.settings, self.engines, self.trainer, self.verifiers = settings, engines, trainer, verifiers
        self.policy = policy
        """The ref of the starting policy, kept while the engines may restart (their constructors read it)."""
        self.tokenizer = tokenizer
        self.timeout_s = settings.health_timeout_s
        self._weights: tuple[int, Any] = (version, None)
        """(version, ref of its weights) the engines must hold; None: those they were built with."""
        self._base_pushed = False
        """Every healthy engine got a push with the base (a LoRA trainer's later pushes carry the adapter alone;
        an engine that restarts loads a push with the base, _load_current)."""
        self.push_seconds = 0.0
        """The last push's wall time, rank 0's read of its weights included."""
        self._broadcaster = (WeightBroadcaster(trainer, settings.weight_backend, settings.health_timeout_s)
                             if settings.weight_sync == "broadcast" else None)
        for engine in engines:
            engine.version = version
        self._requests: dict[str, Submission] = {}
        """Every request submitted and not handed back (queued, on an engine, or finished and not taken)."""
        self._queue: list[str] = []
        self._ready: list[Generation] = []
        self._held: dict[str, Generation] = {}
        """Paused partials, until resumed or aborted."""
        self._routing = False
        self._pausing = False
        """While pause() runs, requests an engine lost wait in the queue: pause hands them back as partials."""
        self._wake = asyncio.Event()
        self._fatal: BaseException | None = None
        self.counts: collections.Counter[str] = collections.Counter()

    # ---- generation -----------------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return max(0, self.settings.engine_slots * len(self.engines) - len(self._requests))

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
               prefix: Generation | None = None) -> None:
        assert request_id not in self._requests, f"request {request_id!r} is already in flight: ids must be unique"
        self._requests[request_id] = Submission(request_id, tuple(prompt_ids), params, prefix)
        self._queue.append(request_id)
        self._schedule_routing()

    def _schedule_routing(self) -> None:
        # The submits of one event-loop turn (a whole admission) go out as one call per engine.
        if not self._routing:
            self._routing = True
            asyncio.get_running_loop().call_soon(self._route)

    def _route(self) -> None:
        """Send the queued requests to healthy engines, each to the least loaded one."""
        self._routing = False
        healthy = [e for e in self.engines if e.healthy]
        if not healthy or not self._queue or self._pausing:
            return
        batches: dict[_Engine, list[Submission]] = collections.defaultdict(list)
        for request_id in self._queue:
            engine = min(healthy, key=lambda e: len(e.requests))
            engine.requests[request_id] = self._requests[request_id]
            batches[engine].append(self._requests[request_id])
        self._queue.clear()
        for engine, batch in batches.items():
            engine.submits.append(engine.actor.submit.remote(batch))
        self._wake.set()  # finished() starts polling the engines that got work

    async def finished(self) -> list[Generation]:
        # Cancel-safe: results land in _ready from the poll tasks, whoever waits for them.
        while not self._ready:
            if self._fatal is not None:
                raise self._fatal
            if not self._requests:
                raise RuntimeError("finished() called with nothing in flight")
            self._wake.clear()
            for engine in self.engines:
                if engine.healthy and engine.requests and engine.poll is None:
                    engine.poll = asyncio.ensure_future(self._poll(engine))
            await self._wake.wait()
        done, self._ready = self._ready, []
        for generation in done:
            del self._requests[generation.request_id]
        return done

    async def _poll(self, engine: _Engine) -> None:
        try:
            report = await self._ask(engine, engine.actor.finished.remote(_POLL_S), "a poll", _POLL_S + self.timeout_s)
            self._accept(engine, report)
        except EngineLost as lost:
            self._recover(engine, lost)
        except RayError as error:  # the engine raised (bad input, a failed step): the loop must see it
            self._fatal = error
        finally:
            engine.poll = None
            self._wake.set()

    async def _ask(self, engine: _Engine, ref: Any, what: str, timeout_s: float | None = None) -> Any:
        """The answer to one engine call, or EngineLost when the actor died or missed the deadline."""
        timeout_s = timeout_s or self.timeout_s
        try:
            return await asyncio.wait_for(ref, timeout_s)
        except asyncio.TimeoutError as error:
            raise EngineLost(f"engine actor {engine.name} did not answer {what} within {timeout_s:.1f} s "
                             "(backend.health_timeout_s)", hung=True) from error
        except ActorUnavailableError as error:  # the call may or may not have run; the actor may be alive
            raise EngineLost(f"engine actor {engine.name} was unavailable for {what}: {brief(error)}",
                             hung=False) from error
        except RayActorError as error:
            raise EngineLost(f"engine actor {engine.name} died: {brief(error)}", hung=False) from error

    def _accept(self, engine: _Engine, report: EngineReport) -> None:
        engine.stats, engine.version = report.stats, report.version
        for generation in report.generations:
            if engine.requests.pop(generation.request_id, None) is not None:  # else no longer its request
                self._ready.append(generation)

    # ---- fault tolerance ------------------------------------------------------------------------------

    def _recover(self, engine: _Engine, lost: EngineLost) -> None:
        """Take the engine out of service, give its requests to the others and bring it back."""
        if not engine.healthy:
            return
        log.warning("%s; its %d requests go to a live engine, and it takes work again once it answers (restarted if "
                    "it died) with the current weights", lost, len(engine.requests))
        self.counts["engine_restarts"] += 1
        self.counts["requeued_requests"] += len(engine.requests)
        if engine.poll is not None and engine.poll is not asyncio.current_task():
            engine.poll.cancel()
        if self._broadcaster is not None:  # a member is gone: the weight group's next push needs a new one
            self._broadcaster.invalidate()
        engine.carried, engine.stats = _plus(engine.carried, engine.stats), EngineStats()
        self._queue[:0] = list(engine.requests)
        engine.requests.clear()
        engine.submits.clear()
        if lost.hung:  # a live but stuck actor: Ray restarts a killed one (max_restarts)
            ray.kill(engine.actor, no_restart=False)
        engine.recovery = asyncio.ensure_future(self._bring_back(engine))
        self._schedule_routing()

    async def _bring_back(self, engine: _Engine) -> None:
        error: Exception | None = None
        for _ in range(_RECOVERY_TRIES):
            try:
                await self._restarted(engine)
                # Not restarted if it was only unavailable: what it still runs was sent elsewhere or is queued.
                await self._ask(engine, engine.actor.reset.remote(), "a reset")
                await self._load_current(engine)
            except EngineLost as lost:
                error = lost
                if lost.hung:
                    ray.kill(engine.actor, no_restart=False)
                continue
            except Exception as failure:  # noqa: BLE001 - no restart mends it (a stopped trainer): the loop raises it
                self._fatal = failure
                self._wake.set()
                return
            engine.recovery = None
            log.warning("engine actor %s is back, at version %d", engine.name, engine.version)
            self._schedule_routing()
            self._wake.set()
            return
        self._fatal = RuntimeError(f"engine actor {engine.name} did not come back after {_RECOVERY_TRIES} restarts "
                                   f"(last: {error}); its stderr in the Ray logs (/tmp/ray/session_latest/logs) says "
                                   "why; `flashreinforce train --resume <run_dir>` continues from the last checkpoint")
        self._wake.set()

    async def _restarted(self, engine: _Engine) -> None:
        """Wait until Ray has restarted the actor (its constructor built a fresh engine) and it answers."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                engine.version = await self._ask(engine, engine.actor.ping.remote(), "a ping after its restart",
                                                 max(1.0, deadline - time.monotonic()))
                return
            except EngineLost as lost:
                if not isinstance(lost.__cause__, ActorUnavailableError) or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.2)  # still restarting

    async def _load_current(self, engine: _Engine) -> None:
        """Load the weights the other engines hold, again if a push came meanwhile."""
        while True:
            version, weights = self._weights
            if weights is _FROM_TRAINER:
                # Rank 0 answers once a step or push it may be running ends: that wait is not the engine's to miss.
                ref = await self.trainer.versioned_weights()
                version = await self._ask(engine, engine.actor.load_versioned.remote(ref), "load_weights")
            elif weights is not None:
                await self._ask(engine, engine.actor.load_weights.remote(weights, version), "load_weights")
            engine.version = version
            if version >= self._weights[0]:  # rank 0's versioned weights may be a step ahead of the last push
                return

    # ---- pause, resume, abort -------------------------------------------------------------------------

    async def pause(self) -> tuple[list[Generation], list[Generation]]:
        self._route()  # queued submissions reach their engines before the pause
        busy = [e for e in self.engines if e.healthy and e.requests]
        self._pausing = True
        try:
            partials = [p for held in await asyncio.gather(*(self._pause_one(e) for e in busy)) for p in held]
        finally:
            self._pausing = False
        partials += [_as_partial(self._requests[i]) for i in self._queue]  # not routed yet, or an engine lost
        self._queue.clear()
        for partial in partials:
            del self._requests[partial.request_id]
            self._held[partial.request_id] = partial
        done, self._ready = self._ready, []
        for generation in done:
            del self._requests[generation.request_id]
        return partials, done

    async def _pause_one(self, engine: _Engine) -> list[Generation]:
        try:
            await self._settle_submits(engine)
            partials, report = await self._ask(engine, engine.actor.pause.remote(), "pause")
            self._accept(engine, report)
            if engine.poll is not None:  # woken by the pause: its answer comes at once
                await asyncio.wait([engine.poll])
        except EngineLost as lost:
            # Its requests go back to the queue, counted as requeued, and pause() hands them back as partials
            # as they were submitted: what it generated for them died with it.
            self._recover(engine, lost)
            return []
        held = [p for p in partials if engine.requests.pop(p.request_id, None) is not None]
        held += [_as_partial(engine.requests.pop(i)) for i in list(engine.requests)]  # none, unless it lost some
        return held

    async def _settle_submits(self, engine: _Engine) -> None:
        submits, engine.submits = engine.submits, []
        for ref in submits:
            await self._ask(engine, ref, "a submit")

    async def resume(self, partials: Sequence[Generation]) -> None:
        """Submit the partials again as prefixes (paused here, or restored from a checkpoint)."""
        for partial in partials:
            self._held.pop(partial.request_id, None)
            self.submit(partial.request_id, partial.prompt_ids, partial.params, partial)

    async def abort(self, request_ids: Sequence[str]) -> list[Generation]:
        aborted = {i: self._held.pop(i) for i in request_ids if i in self._held}
        queued = set(request_ids) & set(self._queue)
        aborted.update((i, _as_partial(self._requests[i])) for i in queued)
        self._queue = [i for i in self._queue if i not in queued]
        owned = [(e, [i for i in request_ids if i in e.requests]) for e in self.engines]
        for found in await asyncio.gather(*(self._abort_on(e, ids) for e, ids in owned if ids)):
            aborted.update((p.request_id, p) for p in found)
        for request_id in aborted:
            self._requests.pop(request_id, None)
        # One that finished before the abort reached its engine comes back through finished(), as locally.
        return [aborted[i] for i in request_ids if i in aborted]

    async def _abort_on(self, engine: _Engine, request_ids: list[str]) -> list[Generation]:
        try:
            await self._settle_submits(engine)
            partials = await self._ask(engine, engine.actor.abort.remote(request_ids), "abort")
        except EngineLost as lost:
            partials = [_as_partial(engine.requests[i]) for i in request_ids if i in engine.requests]
            for partial in partials:
                del engine.requests[partial.request_id]
            self._recover(engine, lost)
            return partials
        return [p for p in partials if engine.requests.pop(p.request_id, None) is not None]

    # ---- weights, training, scoring -------------------------------------------------------------------

    async def push_weights(self) -> int:
        """Rank 0's weights into every healthy engine, between two of its decoding steps: by the weight group
        (backend.weight_sync=broadcast), and through the object store for the engines it did not reach (every
        engine, without a group). An engine restarting now loads them when it is back, before it takes work."""
        started = time.perf_counter()
        try:
            return await self._push(self.trainer.version, [e for e in self.engines if e.healthy])
        finally:
            self.push_seconds = time.perf_counter() - started

    async def _push(self, version: int, engines: list[_Engine]) -> int:
        if self._broadcaster is not None and self._broadcaster.usable and engines:
            self.counts["weight_broadcasts"] += 1
            # Before the broadcast, not after: an engine whose restart completes meanwhile loads `version` from
            # rank 0 (which answers once the broadcast is over), not the last push's weights one version behind.
            self._weights = (version, _FROM_TRAINER)
            answers = await self._broadcaster.push(engines, self._ask)
            engines = self._take_versions(engines, answers, strict=False)
            if not engines:
                self._base_pushed = True  # the group's first push carried the base (WeightBroadcaster.base_sent)
                return version
            self.counts["weight_broadcast_fallbacks"] += 1
        base = not self._base_pushed
        weights = self.trainer.push_ref(base)
        # An adapter alone is no use to an engine that restarts: it loads rank 0's push with the base instead.
        self._weights = (version, weights if base or not self.settings.adapter_pushes else _FROM_TRAINER)
        answers = await asyncio.gather(*(self._ask(e, e.actor.load_weights.remote(weights, version), "load_weights")
                                         for e in engines), return_exceptions=True)
        self._take_versions(engines, answers, strict=True)
        self._base_pushed = True
        return version

    def _take_versions(self, engines: list[_Engine], answers: list[Any], *, strict: bool) -> list[_Engine]:
        """Each engine's answer to a push: a version it now holds, EngineLost (restart it), or a failure: raised
        when `strict`, else the engine is returned among those still to load the weights."""
        missing = []
        for engine, answer in zip(engines, answers):
            if isinstance(answer, EngineLost):
                self._recover(engine, answer)
            elif isinstance(answer, int):
                engine.version = answer
            elif strict and isinstance(answer, BaseException):
                raise answer
            else:
                missing.append(engine)
        return missing

    async def train(self, batch: Sequence[Trajectory]) -> dict[str, float]:
        return await self.trainer.step(batch)

    async def score(self, items: Sequence[tuple[str, Prompt]]) -> list[Verdict]:
        return await self.verifiers.score(items)

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)

    def save_model(self, directory: Path) -> None:
        directory = Path(directory)
        for name, data in self.trainer.model_files().items():
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_bytes(data)
        self.tokenizer.save_pretrained(directory)

    def stats(self) -> dict[str, float]:
        total, live = EngineStats(), [e for e in self.engines if e.healthy] or self.engines
        for engine in self.engines:
            total = _plus(total, _plus(engine.carried, engine.stats))
        metrics = {
            "engine/sampled_tokens": float(total.sampled_tokens),
            "engine/slot_utilization": total.slot_utilization,
            "engine/step_seconds": total.step_seconds,
            # of the engines that generate: a restarting one catches up before it takes work
            "engine/version": float(min(e.version for e in live)),
            "ray/healthy_engines": float(sum(e.healthy for e in self.engines)),
            "ray/weight_push_seconds": self.push_seconds,
        }
        metrics.update({f"ray/{k}": float(v) for k, v in self.counts.items()})
        metrics.update({f"verifier/{k}": float(v) for k, v in self.verifiers.stats().items()})
        return metrics

    async def close(self) -> None:
        """Stop every actor (safe to call twice)."""
        tasks = [t for e in self.engines for t in (e.poll, e.recovery) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for engine in self.engines:
            ray.kill(engine.actor, no_restart=True)
        self.verifiers.close()
        self.trainer.close()
