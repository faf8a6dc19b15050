"""Hostile code under the bwrap level: each attack is contained, and the next call still works.

Every test states what the attack would do if the isolation failed, so that a broken layer fails a test.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import time
from pathlib import Path

import pytest
from sandbox_attacks import (
    BUSY_LOOP,
    COUNT_PROCESSES,
    DEEP_RECURSION,
    FORK_BOMB,
    HUGE_OUTPUT,
    INFINITE_LOOP,
    KERNEL_OBJECTS,
    LEAVE_STATE,
    MEMORY_BOMB,
    MEMORY_TOGETHER,
    RAISE_LIMITS,
    REJOIN_NAMESPACES,
    SEE_STATE,
    SELF_SIGSEGV,
    SLEEPING_FORKS,
    UNBOUNDED_RECURSION,
    connect_loopback,
    kill_parents,
    needs_bwrap,
    read_secrets,
    write_outside,
)

import flashreinforce.sandbox.sandbox as sandbox_module
from flashreinforce.sandbox import Sandbox, SandboxLimits
from flashreinforce.sandbox.sandbox import SLACK_S



def test_a_normal_call_returns_its_output_interleaved_and_exit_code_0(bwrap_sandbox):
    result = bwrap_sandbox.run("import sys\nprint('a')\nprint('b', file=sys.stderr)\nprint('c')")
    assert (result.output, result.exit_code, result.timed_out, result.killed_by, result.bytes_cut) == (
        "a\nb\nc\n", 0, False, None, 0)
    assert result.isolation == "bwrap"


def test_exit_codes_and_tracebacks_are_the_interpreters(bwrap_sandbox):
    assert bwrap_sandbox.run("raise SystemExit(3)").exit_code == 3
    failed = bwrap_sandbox.run("def f():\n    return 1 / 0\nf()")
    assert failed.exit_code == 1
    assert "return 1 / 0" in failed.output and failed.output.rstrip().endswith("ZeroDivisionError: division by zero")


def test_calls_share_no_state(bwrap_sandbox):
    first = bwrap_sandbox.run(LEAVE_STATE)
    assert first.output == "/scratch\n"
    second = bwrap_sandbox.run(SEE_STATE)
    assert second.output == "[] [] [] None\n"


def test_an_infinite_loop_is_killed_at_the_wall_clock(short_sandbox):
    result = short_sandbox.run(INFINITE_LOOP)
    assert result.timed_out and result.killed_by == "SIGKILL" and result.exit_code is None
    assert result.output == "started\n"  # what it printed before the kill is kept
    assert result.seconds < short_sandbox.limits.wall_s + SLACK_S


@pytest.mark.slow
@needs_bwrap
def test_the_cpu_limit_ends_a_busy_process_with_sigxcpu():
    with Sandbox(SandboxLimits(wall_s=10.0, cpu_s=1), isolation="bwrap") as sandbox:
        result = sandbox.run(BUSY_LOOP)
    assert (result.killed_by, result.timed_out) == ("SIGXCPU", False)


def test_a_fork_bomb_is_contained_and_leaves_nothing_behind(short_sandbox):
    result = short_sandbox.run(FORK_BOMB)
    assert result.timed_out and result.seconds < short_sandbox.limits.wall_s + SLACK_S
    after = short_sandbox.run(COUNT_PROCESSES)
    assert after.output == "1\n"  # only itself (the worker is hidden): every process of the bomb is gone


def test_the_process_limit_holds_even_when_we_are_root(bwrap_sandbox):
    # Without a non-root uid outside, the kernel would ignore RLIMIT_NPROC and all 200 forks would succeed.
    result = bwrap_sandbox.run(SLEEPING_FORKS)
    assert int(result.output) == bwrap_sandbox.limits.nproc - 1  # the call's own first process counts
    assert result.seconds < 2  # the sleeping children were killed at once, not waited for


def test_a_memory_bomb_fails_with_memory_error(short_sandbox):
    result = short_sandbox.run(MEMORY_BOMB)
    assert result.exit_code == 1 and "MemoryError" in result.output


def test_processes_together_cannot_exceed_the_memory_limit(bwrap_sandbox):
    # Each child is under RLIMIT_AS (512 MiB); three of them hold 900 MiB between them.
    result = bwrap_sandbox.run(MEMORY_TOGETHER)
    assert (result.killed_by, result.timed_out, result.over_memory) == ("SIGKILL", False, True)
    assert result.seconds < 3  # killed when the sum went over, not at the wall clock


def test_huge_output_is_capped_and_the_cut_counted(bwrap_sandbox):
    result = bwrap_sandbox.run(HUGE_OUTPUT)
    cap = bwrap_sandbox.limits.output_bytes
    assert result.output == "x" * cap
    assert result.bytes_cut == 5_000_001 - cap
    assert result.exit_code == 0


def test_writing_outside_scratch_fails_and_the_host_file_is_not_created(bwrap_sandbox, tmp_path):
    target = tmp_path / "escaped.txt"
    result = bwrap_sandbox.run(write_outside(str(target)))
    assert "WROTE" not in result.output and len(result.output.splitlines()) == 5
    assert not target.exists()


def test_a_loopback_listener_in_the_parent_is_unreachable(bwrap_sandbox):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = bwrap_sandbox.run(connect_loopback(port))
        listener.settimeout(0.1)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert result.output.startswith("PermissionError\n")  # seccomp: no socket at all
    assert f":{port:04X}" not in result.output  # and the network namespace does not even list our listener


@needs_bwrap
def test_secrets_in_the_environment_and_in_files_outside_are_not_readable(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHREINFORCE_TEST_SECRET", "hunter2")
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    with Sandbox(isolation="bwrap") as sandbox:  # started after the secret was set
        result = sandbox.run(read_secrets(str(secret)))
    assert "hunter2" not in result.output
    assert result.output.splitlines()[0] == "['HOME', 'LANG', 'PATH', 'PWD']"


def test_killing_the_parent_from_inside_fails(bwrap_sandbox):
    worker = bwrap_sandbox._worker.process.pid
    result = bwrap_sandbox.run(kill_parents(os.getpid(), worker))
    assert result.exit_code == 0  # kill(-1) was refused, or it would have killed the call itself
    os.kill(os.getpid(), 0)  # we are alive
    assert bwrap_sandbox.run("print('ok')").output == "ok\n"
    assert bwrap_sandbox._worker.process.pid == worker  # the same warm worker: pid 1 ignored the SIGKILL


def test_rejoining_or_making_namespaces_fails(bwrap_sandbox):
    lines = bwrap_sandbox.run(REJOIN_NAMESPACES).output.splitlines()
    assert len(lines) == 9
    assert all(line.endswith((" open 2", " -1 1")) for line in lines), lines  # pid 1 hidden, or EPERM


def test_deep_recursion_is_contained(short_sandbox):
    plain = short_sandbox.run(DEEP_RECURSION)
    assert plain.exit_code == 1 and "RecursionError" in plain.output
    unbounded = short_sandbox.run(UNBOUNDED_RECURSION)
    assert unbounded.exit_code != 0 and unbounded.seconds < short_sandbox.limits.wall_s + SLACK_S
    assert short_sandbox.run("print('ok')").output == "ok\n"


def test_a_dead_worker_is_replaced_by_a_fresh_one(bwrap_sandbox):
    first = bwrap_sandbox._worker.process.pid
    bwrap_sandbox._worker.kill()
    result = bwrap_sandbox.run("print('ok')")
    assert result.output == "ok\n" and bwrap_sandbox._worker.process.pid != first


def test_a_warm_call_costs_a_few_milliseconds(bwrap_sandbox):
    bwrap_sandbox.run("pass")
    seconds = []
    for _ in range(20):
        start = time.perf_counter()
        bwrap_sandbox.run("pass")
        seconds.append(time.perf_counter() - start)
    assert statistics.median(seconds) < 0.05, seconds  # ~3 ms measured; a fresh sandbox per call is ~40 ms


def test_signals_name_the_ending(bwrap_sandbox):
    result = bwrap_sandbox.run(SELF_SIGSEGV)
    assert (result.exit_code, result.killed_by) == (None, "SIGSEGV")


@needs_bwrap
def test_a_worker_that_stops_answering_is_killed_by_the_parents_clock(monkeypatch):
    monkeypatch.setattr(sandbox_module, "SLACK_S", 0.3)
    with Sandbox(SandboxLimits(wall_s=0.3), isolation="bwrap") as sandbox:
        outer = sandbox._worker.process.pid  # bubblewrap; the worker is its child (pid 1 inside)
        worker = int(Path(f"/proc/{outer}/task/{outer}/children").read_text().split()[0])
        os.kill(worker, signal.SIGSTOP)  # as if the worker hung: it can neither kill the call nor answer
        result = sandbox.run("print('hi')")
        assert result.timed_out and result.killed_by == "SIGKILL" and result.exit_code is None
        assert result.seconds < 0.3 + 0.3 + 1.0
        assert sandbox.run("print('ok')").output == "ok\n"  # a fresh worker took its place


def test_the_worker_is_invisible_and_kernel_objects_that_outlive_a_call_cannot_be_made(bwrap_sandbox):
    assert bwrap_sandbox.run(KERNEL_OBJECTS).output == "True\nshmget -1 1\nmq_open -1 1\nabstract socket 1\n"


def test_limits_cannot_be_raised_from_inside(bwrap_sandbox):
    assert bwrap_sandbox.run(RAISE_LIMITS).output == "refused\n" * 4
