"""The Ray backend's verifier actors (controller/ray_verifiers.py) over a fake `ray`, without starting Ray: what
close() leaves behind."""

import asyncio

import pytest

pytest.importorskip("ray")

from flashreinforce.controller import ray_verifiers
from flashreinforce.controller.ray_cluster import RaySettings
from flashreinforce.types import Verdict

pytestmark = pytest.mark.ray


class FakeRay:
    """ray.remote and ray.kill as ray_verifiers uses them. A new actor answers score() at once; its first ping
    (RayVerifiers' wait for a grown actor's start) never comes: the actor is still starting."""

    def __init__(self):
        self.actors, self.killed = [], []

    def remote(self, cls):
        fake = self

        class ActorClass:
            @staticmethod
            def options(**options):
                return ActorClass

            @staticmethod
            def remote(*args):
                fake.actors.append(FakeActor())
                return fake.actors[-1]

        return ActorClass

    def kill(self, actor, no_restart):
        self.killed.append(actor)


class FakeActor:
    class ping:  # noqa: N801 - an actor method's face
        @staticmethod
        def remote():
            return asyncio.get_running_loop().create_future()

    class score:  # noqa: N801
        @staticmethod
        def remote(completions, prompts):
            future = asyncio.get_running_loop().create_future()
            future.set_result(([Verdict(reward=0.0, passed=False)] * len(completions), {}))
            return future


def test_close_stops_a_verifier_actor_that_is_still_starting(monkeypatch):
    fake = FakeRay()
    monkeypatch.setattr(ray_verifiers, "ray", fake)
    settings = RaySettings(address=None, num_engines=1, engine_slots=4, world_size=1, sharded_trainer=False,
                           rollout_device="cpu", trainer_device="cpu", weight_sync="object_store",
                           verifier_workers=(1, 2), env_workers=0, verifier_timeout_s=5.0, health_timeout_s=5.0,
                           step_timeout_s=30.0, torch_threads=1)

    async def run():
        verifiers = ray_verifiers.RayVerifiers(settings, {}, "test")
        verdicts = await verifiers.score([("1", None)] * 40)  # deeper than one actor's share: a second one starts
        await asyncio.sleep(0)
        assert len(verdicts) == 40 and len(fake.actors) == 2 and len(verifiers.active) == 1
        verifiers.close()
        await asyncio.sleep(0)  # the cancelled start runs its cleanup, if it has one

    asyncio.run(run())
    assert [id(a) for a in fake.killed if a is fake.actors[1]], "the starting verifier actor was left running"
    assert {id(a) for a in fake.killed} == {id(a) for a in fake.actors}
