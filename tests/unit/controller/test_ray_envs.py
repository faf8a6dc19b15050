"""Environment workers as Ray actors (controller/ray_envs.py) behind the EnvPool: the same observations as worker
processes, a step that never returns killed at its deadline, an actor killed or crashed mid-episode replaced and
its sessions replayed, and no actor left once the pool closes. One local Ray serves the module."""

from __future__ import annotations

import asyncio
import textwrap
import time

import pytest

ray = pytest.importorskip("ray")

from flashreinforce.controller.ray_envs import RayEnvWorkers  # noqa: E402
from flashreinforce.envs.pool import EnvPool  # noqa: E402
from flashreinforce.envs.protocol import EnvSpec  # noqa: E402
from flashreinforce.types import Prompt  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("local_ray")]  # slow: a Ray start

ENV_MODULE = textwrap.dedent('''
    import os


    class Echo:
        """Observation: the action upper-cased with the step number, seed and history; done after 3 steps."""

        def reset(self, prompt, seed):
            self.seed, self.history = seed, []
            return f"start {prompt.id} seed={seed}"

        def step(self, action):
            if action == "spin":
                while True:
                    pass
            if action == "crash":
                os._exit(3)
            self.history.append(action)
            n = len(self.history)
            return f"{action.upper()} #{n} s{self.seed} h={'/'.join(self.history)}", float(n >= 3), n >= 3, {}

        def close(self):
            pass


    class Broken(Echo):
        def __init__(self):
            raise ValueError("no such level")
''')

PROMPT, OTHER = Prompt("p0", "task", ""), Prompt("p1", "other task", "")
ACTIONS = ("go", "look", "take")


@pytest.fixture
def env_dir(tmp_path):
    (tmp_path / "games.py").write_text(ENV_MODULE)
    return str(tmp_path)


def run_ray_pool(env_dir: str, body, name: str = "Echo", **options) -> RayEnvWorkers:
    """Start an EnvPool of Ray workers, run `body(pool, workers)`, close the pool; the workers' starter."""
    workers = RayEnvWorkers()
    pool = EnvPool(EnvSpec(kind=f"games.py:{name}", base_dir=env_dir), start_worker=workers, **options)

    async def main():
        try:
            await pool.start()
            await body(pool, workers)
        finally:
            await pool.aclose()

    asyncio.run(main())
    return workers


def live_actors(workers: RayEnvWorkers) -> list[str]:
    return [name for name in ray.util.list_named_actors() if name.startswith(workers.prefix)]


def none_left(prefix: str) -> bool:
    """Whether every actor named `prefix...` is gone within 30 s (ray.kill returns before it is)."""
    deadline = time.monotonic() + 30
    while any(name.startswith(prefix) for name in ray.util.list_named_actors()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


async def until_gone(workers: RayEnvWorkers, name: str) -> None:
    """ray.kill returns before the actor is gone: wait until Ray no longer lists it."""
    deadline = time.monotonic() + 30
    while name in live_actors(workers):
        assert time.monotonic() < deadline, f"actor {name} is still alive"
        await asyncio.sleep(0.05)


async def play(pool: EnvPool, sid: str, prompt: Prompt, seed: int, actions=ACTIONS) -> list:
    outcomes = [await pool.reset(sid, prompt, seed)]
    outcomes += [await pool.step(sid, action) for action in actions]
    assert all(o.failure is None for o in outcomes), outcomes
    return [o.value for o in outcomes]


def test_ray_workers_give_the_observations_worker_processes_give(env_dir):
    async def body(remote, workers):
        local = EnvPool(EnvSpec(kind="games.py:Echo", base_dir=env_dir), max_workers=1)
        await local.start()
        try:
            assert len(live_actors(workers)) == 1
            expected = await play(local, "a", PROMPT, 7)
        finally:
            await local.aclose()
        assert await play(remote, "a", PROMPT, 7) == expected
        assert expected[-1].done and expected[-1].observation == "TAKE #3 s7 h=go/look/take"
        remote.close("a")
        assert remote.stats()["sessions"] == 0.0 and remote.counts["calls"] == 4

    workers = run_ray_pool(env_dir, body, max_workers=2)
    assert none_left(workers.prefix)  # the pool's close kills every actor it started


def test_a_spinning_step_kills_its_actor_at_the_deadline_and_the_other_session_replays(env_dir):
    timeout = 1.0

    async def body(pool, workers):
        await pool.reset("victim", PROMPT, 3)
        first = await pool.step("victim", "go")
        await pool.reset("spinner", OTHER, 4)
        (doomed,) = live_actors(workers)
        started = time.monotonic()
        spun = await pool.step("spinner", "spin")
        assert spun.failure == "env_timeout" and timeout <= time.monotonic() - started < timeout + 5
        assert not pool.has("spinner")
        await until_gone(workers, doomed)
        later = [await pool.step("victim", action) for action in ACTIONS[1:]]  # replayed on a new actor
        assert [o.failure for o in later] == [None, None]
        assert pool.counts["replays"] == 1 and pool.counts["workers_started"] == 2
        assert [first.value, *(o.value for o in later)] == (await play(pool, "ref", PROMPT, 3))[1:]

    run_ray_pool(env_dir, body, step_timeout_s=timeout, max_workers=1)


def test_an_actor_killed_between_two_steps_costs_its_episode_nothing(env_dir):
    """Killed from outside (an operator, a lost node): the next step finds the actor dead, replays the episode on
    a new actor and runs there; the episode's observations are those of an uninterrupted one."""

    async def body(pool, workers):
        await pool.reset("kept", PROMPT, 5)
        first = await pool.step("kept", "go")
        (name,) = live_actors(workers)
        ray.kill(ray.get_actor(name), no_restart=True)
        await until_gone(workers, name)
        later = [await pool.step("kept", action) for action in ACTIONS[1:]]
        assert [o.failure for o in later] == [None, None]
        assert pool.counts["crash_retries"] == 1 and pool.counts["workers_lost"] == 1
        assert pool.counts["replays"] == 1 and pool.counts.get("env_crash", 0) == 0
        assert len(live_actors(workers)) == 1  # its replacement
        assert [first.value, *(o.value for o in later)] == (await play(pool, "ref", PROMPT, 5))[1:]

    run_ray_pool(env_dir, body, max_workers=1)


def test_a_step_that_crashes_its_actor_ends_only_its_episode(env_dir):
    async def body(pool, workers):
        await pool.reset("kept", PROMPT, 5)
        first = await pool.step("kept", "go")
        await pool.reset("crasher", OTHER, 6)
        crashed = await pool.step("crasher", "crash")
        assert crashed.failure is not None and crashed.failure.startswith("env_crash: Ray actor"), crashed
        assert not pool.has("crasher") and pool.counts["env_crash"] == 1
        assert pool.counts["workers_lost"] == 2  # it crashed the actor of its retry too
        later = [await pool.step("kept", action) for action in ACTIONS[1:]]  # replayed on a new actor
        assert [first.value, *(o.value for o in later)] == (await play(pool, "ref", PROMPT, 5))[1:]

    run_ray_pool(env_dir, body, max_workers=1)


def test_an_environment_that_cannot_be_built_fails_at_start_naming_env_kind(env_dir):
    async def body(pool, workers):
        raise AssertionError("the pool started")

    with pytest.raises(RuntimeError, match=r"env.kind='games.py:Broken'.*no such level"):
        run_ray_pool(env_dir, body, "Broken")
    assert none_left("flashreinforce-")  # the failed start left no actor
