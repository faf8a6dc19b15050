"""The agent pool: the user's agent in worker processes; its return, raise, bad return, hang (cooperative or one
that blocks its worker's event loop) and crash each end its episode with a reason, and the pool goes on."""

from __future__ import annotations

import asyncio
import time

import pytest

from flashreinforce.envs.agent_worker import check_result
from flashreinforce.envs.agents import AgentPool

pytestmark = pytest.mark.endpoint  # the worker gives the agent an openai client

AGENT = '''
import asyncio, os, time

async def run(client, row):
    kind = row["kind"]
    assert client.base_url.path.endswith("/episodes/ep0/v1/")
    if kind == "reward":
        return 0.5
    if kind == "dict":
        return {"reward": 1, "answer": "42", "passed": True}
    if kind == "none":
        return None
    if kind == "raise":
        raise RuntimeError("the agent broke")
    if kind == "bad":
        return "a string"
    if kind == "sleep":
        await asyncio.sleep(60)
    if kind == "block":
        time.sleep(60)
    if kind == "exit":
        os._exit(3)
    if kind == "slow":
        await asyncio.sleep(0.6)
        return 1.0
    if kind == "slower":
        await asyncio.sleep(1.5)
        return 2.0
'''


@pytest.fixture
def agent_file(tmp_path):
    path = tmp_path / "agent.py"
    path.write_text(AGENT)
    return f"{path}:run"


def run_all(pool: AgentPool, kinds: list[str]) -> list:
    async def main():
        await pool.start()
        try:
            return await asyncio.gather(*(pool.run(f"s{i}", {"kind": kind, "task": ""}, "http://127.0.0.1:9/episodes/ep0/v1",
                                                   "key") for i, kind in enumerate(kinds)))
        finally:
            await pool.aclose()
    return asyncio.run(main())


def test_returns_raises_and_bad_returns_end_their_episodes_with_reasons(agent_file):
    outcomes = run_all(AgentPool(agent_file, timeout_s=30), ["reward", "dict", "none", "raise", "bad"])
    assert [o.value for o in outcomes[:3]] == [0.5, {"reward": 1.0, "answer": "42", "passed": True}, None]
    assert [o.failure for o in outcomes[:3]] == [None, None, None]
    assert outcomes[3].failure == "agent_error: RuntimeError: the agent broke"
    assert outcomes[4].failure.startswith("agent_error: TypeError: the agent returned a str")


def test_a_hang_times_out_and_an_agent_that_blocks_its_worker_gets_it_killed(agent_file):
    pool = AgentPool(agent_file, timeout_s=1.0, cancel_grace_s=0.5, max_workers=1)
    started = time.monotonic()
    sleep, block, slow = run_all(pool, ["sleep", "block", "slow"])
    assert sleep.failure == "agent_timeout" and block.failure == "agent_timeout"
    # the blocked worker's other episode is not at fault: it ends as lost, for its caller to run again
    assert slow.failure in ("agent_lost", "agent_timeout")
    assert pool.counts["workers_lost"] == 1
    assert time.monotonic() - started < 10


def test_a_crashing_agent_ends_as_a_crash_and_a_new_worker_takes_the_next_episode(agent_file):
    pool = AgentPool(agent_file, timeout_s=30, max_workers=1)

    async def main():
        await pool.start()
        try:
            crashed = await pool.run("a", {"kind": "exit", "task": ""}, "http://x/episodes/ep0/v1", "k")
            after = await pool.run("b", {"kind": "reward", "task": ""}, "http://x/episodes/ep0/v1", "k")
            return crashed, after
        finally:
            await pool.aclose()
    crashed, after = asyncio.run(main())
    assert crashed.failure == "agent_crash: exit code 3"
    assert after.value == 0.5 and pool.counts["workers_started"] == 2


def test_time_held_by_a_pause_does_not_count_against_the_deadline(agent_file):
    pool = AgentPool(agent_file, timeout_s=1.0, max_workers=1)

    async def main():
        await pool.start()
        try:
            episode = asyncio.ensure_future(pool.run("s0", {"kind": "slower", "task": ""},
                                                     "http://x/episodes/ep0/v1", "k"))
            await asyncio.sleep(0.05)
            pool.hold({"s0"})  # 1.5 s of work, 1 s allowed: the 2 s held move the deadline past it
            await asyncio.sleep(2.0)
            pool.release()
            return await episode
        finally:
            await pool.aclose()
    assert asyncio.run(main()).value == 2.0


def test_an_agent_that_cannot_load_fails_the_start_saying_why(tmp_path):
    (tmp_path / "sync_agent.py").write_text("def run(client, row):\n    return 1.0\n")
    with pytest.raises(RuntimeError, match="must be `async def run"):
        asyncio.run(AgentPool(f"{tmp_path / 'sync_agent.py'}:run").start())
    with pytest.raises(RuntimeError, match="no file"):
        asyncio.run(AgentPool("missing.py:run").start())


@pytest.mark.parametrize("value", [float("nan"), {"reward": "1"}, {"score": 1.0}, {"answer": 3}, [1.0]])
def test_what_an_agent_may_return_is_checked(value):
    with pytest.raises(TypeError):
        check_result(value)
