"""The pool against reward functions that raise, hang, crash and allocate (tests/unit/verifiers/sample_rewards.py).

No timing asserts: waits poll a condition with a generous deadline, and concurrency limits are
checked on every sample (a limit that is exceeded once is caught).
"""

import asyncio
import os
import time
from pathlib import Path

import pytest

from flashreinforce.types import Prompt, Verdict
from flashreinforce.verifiers.pool import VerifierPool, _CpuMeter

SAMPLES = Path(__file__).with_name("sample_rewards.py")
PROMPT = Prompt(id="p", prompt="2+3=", ground_truth="5")
RIGHT, WRONG = "<think>2+3+0=5;</think>5", "<think>2+3+0=5;</think>6"


def ref(name):
    return f"{SAMPLES}:{name}"


def alive(pid):
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children():
    """PIDs whose parent is this process."""
    mine = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                        mine.add(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return mine


def wait_until(condition, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_math_sync_and_async():
    with VerifierPool(["math"]) as pool:
        assert pool.score_sync(RIGHT, PROMPT) == Verdict(reward=1.0, passed=True, reason="ok",
                                                         seconds=pytest.approx(0.0, abs=1.0))

        async def controller():
            one = await pool.score(WRONG, PROMPT)
            many = await pool.score_many([RIGHT, "<think>2+", WRONG], [PROMPT] * 3)
            return [one.reason] + [v.reason for v in many]

        assert asyncio.run(controller()) == ["wrong", "ok", "no_answer", "wrong"]
        stats = pool.stats()
        assert stats["calls"] == 5 and stats["reason/ok"] == 2 and stats["reason/wrong"] == 2
        assert stats["reason/no_answer"] == 1
        with pytest.raises(ValueError, match="was not loaded by this pool"):
            pool.submit(RIGHT, PROMPT, reward_fn=ref("exact"))
        with pytest.raises(ValueError, match="2 completions for 1 prompts"):
            asyncio.run(pool.score_many([RIGHT, RIGHT], [PROMPT]))


def test_workers_are_fresh_interpreters_with_one_thread():
    # Neither forked from this process nor re-importing its main module (pytest here, a trainer in a run).
    with VerifierPool([ref("environment")]) as pool:
        assert pool.score_sync("", PROMPT).reason == "omp=1 modules="


def test_raise_hang_and_crashes_become_verdicts_and_the_pool_goes_on():
    names = ["exact", "raises", "hangs", "exits", "segfaults", "out_of_memory", "calls_exit", "returns_none"]
    with VerifierPool([ref(n) for n in names], timeout_s=0.5) as pool:
        first_pid = pool.worker_pids()[0]
        reasons = {name: pool.score_sync("5", PROMPT, reward_fn=ref(name)).reason for name in names}
        assert reasons == {
            "exact": "ok",
            "raises": "error: ZeroDivisionError: no reward for you",
            "hangs": "timeout",
            "exits": "crash: exit code 3",
            "segfaults": "crash: killed by SIGSEGV",
            "out_of_memory": "crash: MemoryError: pretend the heap is gone",
            "calls_exit": "crash: SystemExit: 4",
            "returns_none": reasons["returns_none"],
        }
        assert reasons["returns_none"].startswith("error: reward function returned None")
        stats = pool.stats()
        assert stats["reason/error"] == 2 and stats["reason/timeout"] == 1 and stats["reason/crash"] == 4
        assert stats["worker_crashes"] == 4 and stats["workers_started"] == 6  # timeout and crashes replaced
        assert not alive(first_pid)
        # The replacement works like the first worker did.
        assert pool.score_sync("5", PROMPT).reason == "ok" and pool.score_sync("4", PROMPT).reason == "wrong"


def test_memory_limit_turns_a_big_allocation_into_a_crash():
    with VerifierPool([ref("allocates")], memory_limit_mb=256) as pool:
        assert pool.score_sync("16", PROMPT).reason == "ok"
        assert pool.score_sync("1024", PROMPT).reason == "crash: MemoryError"
        assert pool.score_sync("16", PROMPT).reason == "ok"


def test_grows_while_calls_wait_and_cpus_are_idle_then_retires_idle_workers():
    with VerifierPool([ref("slow")], min_workers=1, max_workers=3, idle_timeout_s=0.2,
                      idle_cpus=lambda: 8.0) as pool:
        futures = [pool.submit("0.4", PROMPT) for _ in range(6)]
        peak = 0
        while not all(f.done() for f in futures):
            peak = max(peak, pool.stats()["workers"])
            assert pool.stats()["workers"] <= 3
            time.sleep(0.01)
        assert all(f.result().reason == "ok" for f in futures)
        assert peak == 3 and pool.stats()["workers_started"] == 3
        wait_until(lambda: pool.stats()["workers"] == 1)  # idle ones retire, down to min_workers


def test_does_not_grow_when_no_cpu_is_idle():
    with VerifierPool([ref("slow")], min_workers=1, max_workers=3, idle_cpus=lambda: 0.0) as pool:
        futures = [pool.submit("0.1", PROMPT) for _ in range(4)]
        assert all(f.result().reason == "ok" for f in futures)
        assert pool.stats()["workers_started"] == 1


def test_yield_cpus_limits_running_calls_to_min_workers():
    with VerifierPool([ref("slow")], min_workers=1, max_workers=2, idle_cpus=lambda: 8.0) as pool:
        warm = [pool.submit("0.3", PROMPT) for _ in range(4)]
        assert all(f.result().reason == "ok" for f in warm) and pool.stats()["workers"] == 2
        with pool.yield_cpus():
            futures = [pool.submit("0.1", PROMPT) for _ in range(4)]
            while not all(f.done() for f in futures):
                stats = pool.stats()
                assert stats["running"] <= 1 and stats["limit"] == 1
                time.sleep(0.005)
        assert pool.stats()["limit"] == 2
        futures = [pool.submit("0.25", PROMPT) for _ in range(2)]  # both are dispatched in one pass
        wait_until(lambda: pool.stats()["running"] == 2)  # both parked workers run again
        assert all(f.result().reason == "ok" for f in futures)


def test_min_workers_zero_retires_everyone_and_starts_on_demand():
    with VerifierPool(["math"], min_workers=0, max_workers=1, idle_timeout_s=0.2, idle_cpus=lambda: 0.0) as pool:
        wait_until(lambda: pool.stats()["workers"] == 0)
        assert pool.score_sync(RIGHT, PROMPT).reason == "ok"
        assert pool.stats()["workers_started"] == 2


def test_close_ends_every_process_it_started():
    before = children()
    pool = VerifierPool([ref("spawns_child"), ref("hangs")], min_workers=2, max_workers=2, timeout_s=30)
    grandchild = int(pool.score_sync("", PROMPT).reward)  # a `sleep 60` the reward function left behind
    pending = pool.submit("", PROMPT, reward_fn=ref("hangs"))
    wait_until(lambda: pool.stats()["running"] == 1)
    pids = pool.worker_pids()
    assert len(pids) == 2 and set(pids) <= children() and alive(grandchild)
    pool.close()
    assert not any(alive(pid) for pid in pids)
    wait_until(lambda: not alive(grandchild))  # SIGKILLed with its worker's group (not ours to reap)
    assert children() == before
    with pytest.raises(RuntimeError, match="closed before this call finished"):
        pending.result()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("", PROMPT)


def test_bad_reference_fails_at_startup_and_leaves_no_process():
    before = children()
    with pytest.raises(ValueError, match=r"missing.py:fn': file /.*/missing.py not found"):
        VerifierPool(["math", "missing.py:fn"])
    with pytest.raises(ValueError, match=r"has no 'absent'"):
        VerifierPool([ref("absent")])
    assert children() == before


def test_cancelled_call_is_not_run():
    with VerifierPool([ref("slow")], max_workers=1) as pool:
        first = pool.submit("0.3", PROMPT)
        second = pool.submit("0.0", PROMPT)
        assert second.cancel()
        assert first.result().reason == "ok" and second.cancelled()
        assert pool.score_sync("0.0", PROMPT).reason == "ok"
        assert pool.stats()["calls"] == 2


def test_default_cpu_meter_reads_a_plausible_idle_count():
    meter = _CpuMeter()
    for _ in range(2):
        time.sleep(0.15)
        assert 0.0 <= meter() <= os.cpu_count()


BATCH_MODULE = '''
import json
import os
import time

from flashreinforce.verifiers.rewards import BatchedRewardFn

def _score_batch(completions, ground_truths, prompts):
    with open(os.path.join(os.path.dirname(__file__), "batches.jsonl"), "a") as log:
        log.write(json.dumps(list(completions)) + "\\n")
    rewards = []
    for completion in completions:
        if completion.startswith("sleep "):
            time.sleep(float(completion.split()[1]))
        elif completion == "exit":
            os._exit(3)
        elif completion == "stop":
            raise SystemExit(4)
        elif completion == "raise":
            raise ZeroDivisionError("no batch for you")
        rewards.append(1.0 if completion.startswith("sleep ") else float(completion))
    return rewards

scores = BatchedRewardFn(_score_batch, batch_size=4)
'''


@pytest.fixture
def batched(tmp_path):
    """(ref, batches()): a batchable reward function (batch_size 4, reward = float(completion); `sleep S` sleeps
    (reward 1), `exit` kills its worker, `stop` asks it to exit, `raise` raises) and the completions of each batch
    it was called with, in order."""
    import json

    (tmp_path / "batched_rewards.py").write_text(BATCH_MODULE)
    log = tmp_path / "batches.jsonl"
    return f"{tmp_path / 'batched_rewards.py'}:scores", lambda: [json.loads(r) for r in log.read_text().splitlines()]


def test_queued_calls_of_a_batchable_function_go_to_a_worker_in_batches(batched):
    batch_ref, batches = batched
    with VerifierPool([batch_ref, ref("exact")], max_workers=1) as pool:
        first = pool.submit("sleep 0.3", PROMPT)
        wait_until(lambda: pool.stats()["running"] == 1)
        futures = [pool.submit(c, PROMPT, reward_fn=r) for c, r in
                   [("1", None), ("5", ref("exact")), ("2", None), ("3", None), ("4", None), ("6", None)]]
        assert first.result(timeout=30).reward == 1.0
        assert [f.result(timeout=30).reward for f in futures] == [1.0, 1.0, 2.0, 3.0, 4.0, 6.0]  # each its own
        # Up to batch_size calls of the same reference, in queue order; the other reference's call in between neither
        # joined the batch nor ended it, and went alone.
        assert batches() == [["sleep 0.3"], ["1", "2", "3", "4"], ["6"]]
        stats = pool.stats()
        assert stats["batches"] == 4 and stats["calls"] == 7 and stats["reason/ok"] == 7


def test_a_crash_timeout_or_raise_in_a_batch_answers_each_of_its_calls(batched):
    batch_ref, batches = batched
    with VerifierPool([batch_ref], max_workers=1, timeout_s=2.0) as pool:
        def one_batch(completions):
            blocker = pool.submit("sleep 0.3", PROMPT)  # the next calls queue up behind it, then go as one batch
            wait_until(lambda: pool.stats()["running"] == 1)
            futures = [pool.submit(c, PROMPT) for c in completions]
            assert blocker.result(timeout=30).reason == "ok"
            return [f.result(timeout=30).reason for f in futures]  # a call left unanswered fails here

        assert one_batch(["1", "exit", "2"]) == ["crash: exit code 3"] * 3
        assert one_batch(["1", "stop", "2"]) == ["crash: SystemExit: 4"] * 3
        assert one_batch(["1", "sleep 30", "2"]) == ["timeout"] * 3
        assert one_batch(["1", "raise", "2"]) == ["error: ZeroDivisionError: no batch for you"] * 3
        assert pool.score_sync("7", PROMPT).reward == 7.0  # the replaced worker scores as the first did
        assert batches()[1::2] == [["1", c, "2"] for c in ("exit", "stop", "sleep 30", "raise")]
        stats = pool.stats()
        assert stats["worker_crashes"] == 2 and stats["reason/crash"] == 6 and stats["reason/timeout"] == 3
        assert stats["reason/error"] == 3 and stats["workers_started"] == 4 and stats["calls"] == 17
