"""EnvPool: environments in killable worker processes, per-call deadlines, replay of lost sessions.

The environments are user code in a file written to tmp_path (workers are separate interpreters, so they
load it by `file.py:Class`, as a recipe's env.kind does)."""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap
import time

import pytest

from flashreinforce.envs.pool import EnvPool
from flashreinforce.envs.protocol import EnvSpec, StepResult
from flashreinforce.types import Prompt

ENV_MODULE = textwrap.dedent('''
    import os
    import time


    class EchoEnv:
        """Observation: the action upper-cased, with the step number and the seed; done after 3 steps."""

        def __init__(self, steps=3):
            self.steps = steps

        def reset(self, prompt, seed):
            self.seed, self.history = seed, []
            return f"start {prompt.id} seed={seed}"

        def step(self, action):
            self.history.append(action)
            n = len(self.history)
            done = n >= self.steps
            return f"{action.upper()} #{n} s{self.seed} h={'/'.join(self.history)}", float(done), done, {"n": n}

        def close(self):
            pass


    class SlowEnv(EchoEnv):
        def step(self, action):
            if action == "spin":
                while True:
                    pass
            if action.startswith("sleep"):
                time.sleep(float(action.split()[1]))
            return super().step(action)


    class CrashEnv(EchoEnv):
        def step(self, action):
            if action == "crash":
                os._exit(3)
            return super().step(action)


    class RaiseEnv(EchoEnv):
        def step(self, action):
            if action == "raise":
                raise ValueError("cannot apply raise")
            return super().step(action)


    class NoStep:
        def reset(self, prompt, seed):
            return ""

        def close(self):
            pass
''')

PROMPT = Prompt("p0", "task", "")
OTHER = Prompt("p1", "other task", "")


@pytest.fixture
def env_dir(tmp_path):
    (tmp_path / "my_envs.py").write_text(ENV_MODULE)
    return str(tmp_path)


def spec(env_dir: str, name: str) -> EnvSpec:
    return EnvSpec(kind=f"my_envs.py:{name}", base_dir=env_dir)


def run(main):
    return asyncio.run(main())


async def with_pool(pool: EnvPool, body):
    procs = []
    try:
        await pool.start()
        return await body(pool)
    finally:
        procs = [w.link.proc for w in pool._workers]
        await pool.aclose()
        assert not pool._workers and all(p.poll() is not None for p in procs)  # no worker left running


def echo(action: str, n: int, seed: int, history: list[str]) -> str:
    return f"{action.upper()} #{n} s{seed} h={'/'.join(history)}"


def test_reset_step_close_and_the_counts(env_dir):
    async def body(pool):
        reset = await pool.reset("a", PROMPT, 7)
        assert reset.failure is None and reset.value == "start p0 seed=7"
        outcomes = [await pool.step("a", action) for action in ("go", "look", "take")]
        assert all(o.failure is None and isinstance(o.value, StepResult) for o in outcomes)
        assert [o.value.observation for o in outcomes] == [echo("go", 1, 7, ["go"]), echo("look", 2, 7, ["go", "look"]),
                                                          echo("take", 3, 7, ["go", "look", "take"])]
        assert [o.value.reward for o in outcomes] == [0.0, 0.0, 1.0]
        assert [o.value.done for o in outcomes] == [False, False, True]
        assert outcomes[0].value.info == {"n": 1}
        assert pool._sessions["a"].actions == ["go", "look", "take"]
        stats = pool.stats()
        assert stats["calls"] == 4.0 and stats["sessions"] == 1.0 and stats["workers"] == 1.0
        assert stats["workers_started"] == 1.0 and stats.get("replays", 0.0) == 0.0 and stats["busy_seconds"] > 0
        pool.close("a")
        assert not pool.has("a") and pool.stats()["sessions"] == 0.0
        with pytest.raises(KeyError, match="reset or attach"):
            await pool.step("a", "go")

    run(lambda: with_pool(EnvPool(spec(env_dir, "EchoEnv"), step_timeout_s=10, max_workers=1), body))


def test_a_spinning_step_is_killed_at_its_deadline_and_the_workers_other_session_replays(env_dir):
    timeout = 0.5

    async def body(pool):
        await pool.reset("victim", PROMPT, 3)
        await pool.reset("spinner", OTHER, 4)
        first = await pool.step("victim", "go")
        assert pool._sessions["victim"].worker is pool._sessions["spinner"].worker  # both on the one worker
        started = time.monotonic()
        spun = await pool.step("spinner", "spin")
        took = time.monotonic() - started
        assert spun.failure == "env_timeout" and spun.value is None
        assert timeout <= took < timeout + 1.0, took  # killed at the deadline, not after the step
        assert not pool.has("spinner")  # its episode ended
        assert pool.counts["workers_lost"] == 1 and pool.counts["env_timeout"] == 1

        # the victim's next steps replay ["go"] on a new worker: the same as an uninterrupted run
        later = [await pool.step("victim", a) for a in ("look", "take")]
        assert [o.failure for o in later] == [None, None]
        assert pool.counts["replays"] >= 1 and pool.counts["workers_started"] == 2

        await pool.reset("reference", PROMPT, 3)
        reference = [await pool.step("reference", a) for a in ("go", "look", "take")]
        assert [first.value, *(o.value for o in later)] == [o.value for o in reference]
        assert later[-1].value.done and later[-1].value.observation == echo("take", 3, 3, ["go", "look", "take"])

    run(lambda: with_pool(EnvPool(spec(env_dir, "SlowEnv"), step_timeout_s=timeout, max_workers=1), body))


def test_a_crash_ends_only_its_episode_and_the_pool_keeps_working(env_dir):
    async def body(pool):
        await pool.reset("ok", PROMPT, 1)
        await pool.step("ok", "go")
        await pool.reset("bad", OTHER, 2)
        crashed = await pool.step("bad", "crash")
        assert crashed.failure is not None and crashed.failure.startswith("env_crash:"), crashed
        assert "exit code 3" in crashed.failure
        assert not pool.has("bad") and pool.counts["env_crash"] == 1
        assert pool.counts["crash_retries"] == 1 and pool.counts["workers_lost"] == 2  # it crashed its retry too
        after = await pool.step("ok", "look")  # replayed on a fresh worker
        assert after.failure is None and after.value.observation == echo("look", 2, 1, ["go", "look"])
        await pool.reset("new", OTHER, 2)
        assert (await pool.step("new", "go")).value.observation == echo("go", 1, 2, ["go"])

    run(lambda: with_pool(EnvPool(spec(env_dir, "CrashEnv"), step_timeout_s=10, max_workers=1), body))


def test_a_worker_killed_between_two_steps_costs_its_episodes_nothing(env_dir):
    """Killed from outside (an operator, the OOM killer): the next call finds it dead, replays the episode on a
    new worker and runs there, so the episode goes on as if nothing happened."""

    async def body(pool):
        await pool.reset("a", PROMPT, 4)
        first = await pool.step("a", "go")
        (worker,) = pool._workers
        os.killpg(worker.link.proc.pid, signal.SIGKILL)
        worker.link.proc.wait()
        later = [await pool.step("a", action) for action in ("look", "take")]
        assert [o.failure for o in later] == [None, None]
        assert pool.counts["crash_retries"] == 1 and pool.counts["replays"] == 1 and pool.counts["workers_lost"] == 1
        assert pool.counts.get("env_crash", 0) == 0 and pool._sessions["a"].actions == ["go", "look", "take"]
        assert [first.value.observation, *(o.value.observation for o in later)] == [
            echo("go", 1, 4, ["go"]), echo("look", 2, 4, ["go", "look"]), echo("take", 3, 4, ["go", "look", "take"])]

    run(lambda: with_pool(EnvPool(spec(env_dir, "EchoEnv"), step_timeout_s=10, max_workers=1), body))


def test_a_raising_step_is_an_env_error_and_closes_its_session(env_dir):
    async def body(pool):
        await pool.reset("ok", PROMPT, 1)
        await pool.reset("bad", OTHER, 2)
        raised = await pool.step("bad", "raise")
        assert raised.failure == "env_error: ValueError: cannot apply raise"
        assert not pool.has("bad") and pool.counts["env_error"] == 1
        assert pool.counts.get("workers_lost", 0) == 0  # the worker lives on, with its other session
        after = await pool.step("ok", "go")
        assert after.failure is None and after.value.observation == echo("go", 1, 1, ["go"])
        assert pool.counts.get("replays", 0) == 0
        with pytest.raises(KeyError):
            await pool.step("bad", "go")

    run(lambda: with_pool(EnvPool(spec(env_dir, "RaiseEnv"), step_timeout_s=10, max_workers=1), body))


def test_a_cancelled_step_does_not_hand_its_answer_to_the_next_call_on_its_worker(env_dir):
    async def body(pool):
        await pool.reset("cancelled", PROMPT, 1)
        await pool.reset("next", OTHER, 2)
        step = asyncio.ensure_future(pool.step("cancelled", "sleep 0.3"))
        await asyncio.sleep(0.05)  # running in the worker
        step.cancel()
        await asyncio.gather(step, return_exceptions=True)
        after = await pool.step("next", "go")
        assert after.value.observation == echo("go", 1, 2, ["go"])  # not the cancelled step's late answer
        # the cancelled action was not applied: the session goes on (by replay) as if it was never sent
        assert pool._sessions["cancelled"].actions == []
        assert (await pool.step("cancelled", "look")).value.observation == echo("look", 1, 1, ["look"])

    run(lambda: with_pool(EnvPool(spec(env_dir, "SlowEnv"), step_timeout_s=10, max_workers=1), body))


def test_attach_then_step_replays_from_the_seeded_reset(env_dir):
    actions = ["go", "look", "take"]

    async def body(pool):
        await pool.reset("live", PROMPT, 5)
        live = [await pool.step("live", a) for a in actions]
        pool.attach("restored", PROMPT, 5, tuple(actions[:2]))
        assert pool.has("restored") and pool._sessions["restored"].worker is None
        restored = await pool.step("restored", actions[2])
        assert restored.failure is None and restored.value == live[2].value
        assert pool.counts["replays"] == 1
        assert pool._sessions["restored"].actions == actions
        # a different seed replays to a different state: the replay really starts from the seeded reset
        pool.attach("other_seed", PROMPT, 6, tuple(actions[:2]))
        assert (await pool.step("other_seed", actions[2])).value.observation == echo("take", 3, 6, actions)

    run(lambda: with_pool(EnvPool(spec(env_dir, "EchoEnv"), step_timeout_s=10, max_workers=2), body))


def test_a_slow_step_does_not_block_another_sessions_step(env_dir):
    async def body(pool):
        await pool.reset("slow", PROMPT, 1)
        await pool.reset("fast", OTHER, 2)
        assert pool._sessions["slow"].worker is not pool._sessions["fast"].worker
        order: list[str] = []

        async def step(sid, action):
            outcome = await pool.step(sid, action)
            order.append(sid)
            return outcome

        started = time.monotonic()
        slow = asyncio.ensure_future(step("slow", "sleep 0.6"))
        await asyncio.sleep(0.05)  # the slow step is running in its worker
        fast = await step("fast", "go")
        fast_took = time.monotonic() - started
        assert fast.failure is None and fast_took < 0.45, fast_took
        assert (await slow).failure is None
        assert order == ["fast", "slow"]

    run(lambda: with_pool(EnvPool(spec(env_dir, "SlowEnv"), step_timeout_s=10, min_workers=2, max_workers=2), body))


def test_the_pool_grows_to_max_workers_when_every_worker_is_busy(env_dir):
    async def body(pool):
        await pool.reset("a", PROMPT, 1)
        await pool.reset("b", OTHER, 2)  # the one worker is idle again: b joins it
        assert pool.stats()["workers"] == 1.0
        steps = [pool.step("a", "sleep 0.2"), pool.reset("c", PROMPT, 3)]  # c arrives while a's worker is busy
        outcomes = await asyncio.gather(*steps)
        assert all(o.failure is None for o in outcomes)
        assert pool.stats()["workers"] == 2.0 and pool._sessions["c"].worker is not pool._sessions["a"].worker

    run(lambda: with_pool(EnvPool(spec(env_dir, "SlowEnv"), step_timeout_s=10, max_workers=2), body))


@pytest.mark.parametrize(("kind", "reason"), [
    ("missing.py:EchoEnv", "no file"),
    ("my_envs.py:NoStep", "lacks step"),
    ("my_envs.py:Nowhere", "has no class 'Nowhere'"),
])
def test_an_environment_that_cannot_be_built_fails_at_start_naming_env_kind(env_dir, kind, reason):
    pool = EnvPool(EnvSpec(kind=kind, base_dir=env_dir))

    async def main():
        try:
            with pytest.raises(RuntimeError) as caught:
                await pool.start()
        finally:
            await pool.aclose()
        return str(caught.value)

    message = run(main)
    assert f"env.kind={kind!r}" in message and reason in message, message
    assert not pool._workers


def test_bad_worker_counts_are_refused(env_dir):
    with pytest.raises(ValueError, match="min_workers"):
        EnvPool(spec(env_dir, "EchoEnv"), min_workers=3, max_workers=2)


class FakeWorker:
    """A WorkerLink without a process: its start takes `start_s`, each step 0.1 s."""

    def __init__(self, start_s: float) -> None:
        self.start_s = start_s

    async def start(self, spec, timeout):
        await asyncio.sleep(self.start_s)
        return "ready", None

    async def call(self, message, timeout):
        if message[0] == "step":
            await asyncio.sleep(0.1)
        return "ok", StepResult(f"after {message[-1]}", 0.0, False, {})

    def send(self, message):
        pass

    def stop(self):
        pass


def test_a_worker_start_does_not_hold_up_calls_to_the_workers_already_running():
    """One more worker starts (2 s, as a slow import would) while the first one answers two 0.1 s steps: each
    step must take its 0.1 s, not wait behind the start; the pool still grows only to max_workers."""
    starts: list[FakeWorker] = []

    def start_worker() -> FakeWorker:  # the first worker starts at once, every later one takes 2 s
        starts.append(FakeWorker(2.0 if starts else 0.0))
        return starts[-1]

    async def main():
        pool = EnvPool(EnvSpec(kind="fake"), step_timeout_s=10, max_workers=2, start_worker=start_worker)
        await pool.start()
        try:
            await pool.reset("a", PROMPT, 1)
            first = asyncio.ensure_future(pool.step("a", "go"))  # the one worker is busy for 0.1 s
            await asyncio.sleep(0.01)
            grow = asyncio.ensure_future(pool.reset("b", OTHER, 2))  # every worker busy: one more starts
            started = time.monotonic()
            assert (await first).failure is None
            took_first = time.monotonic() - started
            started = time.monotonic()
            assert (await pool.step("a", "look")).failure is None  # on the first worker, idle again
            took_second = time.monotonic() - started
            assert took_first < 0.5 and took_second < 0.5, (took_first, took_second)
            assert not grow.done() and len(starts) == 2
            assert (await grow).failure is None
            assert pool.stats()["workers"] == 2.0 and pool._sessions["b"].worker is not pool._sessions["a"].worker
            third = await pool.reset("c", PROMPT, 3)  # at max_workers: c waits for an idle worker, none starts
            assert third.failure is None and pool.stats()["workers"] == 2.0 and len(starts) == 2
        finally:
            await pool.aclose()
        assert not pool._workers

    run(main)
