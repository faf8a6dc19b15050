"""The Ray backend's engine recovery (controller/ray_backend.py) driven step by step over fake actors, without
starting Ray: the interleavings that matter (a restart that completes while a broadcast push is in progress, an
actor that is only unavailable for a moment) are forced here instead of waited for."""

import asyncio
import contextlib

import pytest

ray = pytest.importorskip("ray")

from ray.exceptions import ActorUnavailableError, RayError, RayTaskError  # noqa: E402

from flashreinforce.controller.ray_actors import EngineReport  # noqa: E402
from flashreinforce.controller.ray_backend import EngineLost, RayBackend, _Engine  # noqa: E402
from flashreinforce.controller.ray_cluster import RaySettings  # noqa: E402
from flashreinforce.rollout.engine import EngineStats  # noqa: E402
from flashreinforce.types import Generation, SamplingParams  # noqa: E402

pytestmark = pytest.mark.ray

PARAMS = SamplingParams(max_new_tokens=4)
DEADLINE_S = 10.0


class Handle:
    """An actor handle as Ray gives one: `handle.method.remote(*args)` is an awaitable of the answer, and what the
    actor raises arrives as a RayTaskError. `unavailable` names methods whose next call fails the way a moment's
    unavailability does (ActorUnavailableError, the actor left as it was)."""

    def __init__(self, actor):
        self._actor, self.unavailable = actor, set()

    def __getattr__(self, method):
        handle = self

        class Method:
            @staticmethod
            def remote(*args):
                return asyncio.ensure_future(handle._call(method, args))

        return Method

    async def _call(self, method, args):
        if method in self.unavailable:
            self.unavailable.discard(method)
            raise ActorUnavailableError("connection reset", None)
        try:
            return await getattr(self._actor, method)(*args)
        except Exception as error:  # what Ray does with an actor's exception
            raise RayTaskError(method, "", error) from error


class FakeEngineActor:
    """ray_actors.EngineActor's face over a pretend engine: requests finish when the test says so."""

    def __init__(self, version):
        self.version = version
        self.running = {}
        """request_id -> the version the engine held when it took the request."""
        self.done, self.failure = [], None
        self.submits = 0
        """submit() calls so far."""
        self.wake = asyncio.Event()
        self.restart = None
        """While set to an Event, the actor is restarting: a ping waits for it."""

    async def ping(self):
        if self.restart is not None:
            await self.restart.wait()
        return self.version

    async def load_weights(self, weights, version):
        self.version = version
        return version

    async def load_versioned(self, versioned):
        return await self.load_weights(versioned[1], versioned[0])

    async def submit(self, requests):
        self.submits += 1
        for request in requests:
            if request.request_id in self.running:  # as rollout.AsyncEngine answers a duplicate
                self.failure = ValueError(f"request {request.request_id!r} is already in flight: ids must be unique")
                self.wake.set()
            self.running[request.request_id] = self.version

    async def finished(self, wait_s):
        if not self.done and self.failure is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), wait_s)
        self.wake.clear()
        if self.failure is not None:
            raise self.failure
        done, self.done = self.done, []
        return EngineReport(done, EngineStats(), self.version)

    async def reset(self):
        self.running.clear()
        self.done.clear()

    def finish(self, request_id):
        version = self.running.pop(request_id)
        self.done.append(Generation(request_id, (1, 2), (3,), (-0.5,), (version,), (1,), "length", PARAMS))
        self.wake.set()


class FakeTrainer:
    """RayTrainer's face for pushes: rank 0 at `version`."""

    def __init__(self, version):
        self.version = version

    def weights_ref(self):
        return f"weights-{self.version}"

    async def versioned_weights(self):
        return (self.version, f"weights-{self.version}")

    def close(self):
        pass


class FakeVerifiers:
    def stats(self):
        return {}

    def close(self):
        pass


class HeldBroadcaster:
    """A weight group whose push is held open until the test releases it; every member then holds the version."""

    def __init__(self, trainer):
        self.trainer, self.usable = trainer, True
        self.pushing, self.release = asyncio.Event(), asyncio.Event()

    def invalidate(self):
        pass

    async def push(self, engines, ask):
        self.pushing.set()
        await self.release.wait()
        for engine in engines:
            engine.actor._actor.version = self.trainer.version
        return [self.trainer.version for _ in engines]


def settings(num_engines, weight_sync):
    return RaySettings(address=None, num_engines=num_engines, engine_slots=4, world_size=1, sharded_trainer=False,
                       rollout_device="cpu", trainer_device="cpu", weight_sync=weight_sync, verifier_workers=(1, 1),
                       env_workers=0, verifier_timeout_s=5.0, health_timeout_s=5.0, step_timeout_s=30.0,
                       torch_threads=1)


def backend_over(actors, trainer, weight_sync):
    engines = [_Engine(f"engine-{i}", Handle(actor)) for i, actor in enumerate(actors)]
    return RayBackend(settings(len(actors), weight_sync), engines, trainer, FakeVerifiers(), policy=None,
                      tokenizer=None, version=actors[0].version)


async def stop(backend):
    """RayBackend.close() without ray.kill (nothing here is a Ray actor): its poll and recovery tasks end."""
    tasks = [t for e in backend.engines for t in (e.poll, e.recovery) if t is not None]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def until(condition, what):
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.001)


def test_an_engine_whose_restart_completes_during_a_broadcast_comes_back_at_the_pushed_version():
    """The last push went through the object store (version 1); rank 0 has stepped to 2 and its broadcast is in
    progress when the restarted engine loads: it must load 2, not the object store's 1, before it takes work."""

    async def run():
        trainer = FakeTrainer(version=1)
        live, restarting = FakeEngineActor(version=1), FakeEngineActor(version=0)
        backend = backend_over([live, restarting], trainer, "broadcast")
        backend._weights = (1, "weights-1")
        broadcaster = backend._broadcaster = HeldBroadcaster(trainer)
        engine = backend.engines[1]
        restarting.restart = asyncio.Event()
        backend._recover(engine, EngineLost("engine actor engine-1 died", hung=False))
        trainer.version = 2  # an optimizer step
        push = asyncio.ensure_future(backend.push_weights())
        await broadcaster.pushing.wait()
        restarting.restart.set()  # the restart completes while the broadcast is in progress
        await until(lambda: engine.healthy or backend._fatal is not None, "the engine did not come back")
        back_at = (engine.version, restarting.version)
        broadcaster.release.set()
        assert await push == 2
        backend.submit("r0", [1, 2], PARAMS)
        backend.submit("r1", [1, 2], PARAMS)
        await until(lambda: restarting.running, "the restarted engine got no request")
        await stop(backend)
        return back_at, restarting.running

    back_at, taken = asyncio.run(run())
    assert back_at == (2, 2), f"the restarted engine came back at version {back_at[0]}, one behind the push"
    assert set(taken.values()) == {2}


def test_an_actor_unavailable_for_a_moment_takes_its_requests_again_without_stopping_the_run():
    """ActorUnavailableError on a poll: the call may or may not have run, and the actor may still hold its
    requests. With one engine they are sent to it again; that must not meet the copies it still runs."""

    async def run():
        actor = FakeEngineActor(version=0)
        backend = backend_over([actor], FakeTrainer(version=0), "object_store")
        backend.engines[0].actor.unavailable.add("finished")
        for request_id in ("r0", "r1"):
            backend.submit(request_id, [1, 2], PARAMS)
        finishing = asyncio.ensure_future(backend.finished())
        await until(lambda: actor.submits == 2 or finishing.done(), "the requests were not sent again")
        for request_id in list(actor.running) if not finishing.done() else []:
            actor.finish(request_id)
        got = []
        try:
            while len(got) < 2:
                got += await asyncio.wait_for(finishing, DEADLINE_S)
                finishing = asyncio.ensure_future(backend.finished()) if len(got) < 2 else finishing
        finally:
            await stop(backend)
        return got, backend.counts["requeued_requests"]

    try:
        got, requeued = asyncio.run(run())
    except RayError as error:
        pytest.fail(f"the run stopped: {getattr(error, 'cause', error)!r}")
    assert sorted(g.request_id for g in got) == ["r0", "r1"] and requeued == 2
