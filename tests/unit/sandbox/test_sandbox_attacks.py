"""Hostile code under the bwrap level: each attack is contained, and the next call still works.

Every test states what the attack would do if the isolation failed, so that a broken layer fails a test.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import statistics
import time
from pathlib import Path

import pytest

import flashreinforce.sandbox.sandbox as sandbox_module
from flashreinforce.sandbox import Sandbox, SandboxLimits
from flashreinforce.sandbox.sandbox import SLACK_S

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bwrap is not installed (apt-get install bubblewrap)")


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
    first = bwrap_sandbox.run("import os\nopen('left.txt', 'w').write('x')\nopen('/tmp/left.txt', 'w').write('x')\n"
                              "open('/dev/shm/left', 'w').write('x')\nos.environ['LEFT'] = '1'\nprint(os.getcwd())")
    assert first.output == "/scratch\n"
    second = bwrap_sandbox.run("import os\nprint(os.listdir('.'), os.listdir('/tmp'), os.listdir('/dev/shm'), "
                               "os.environ.get('LEFT'))")
    assert second.output == "[] [] [] None\n"


def test_an_infinite_loop_is_killed_at_the_wall_clock(short_sandbox):
    result = short_sandbox.run("print('started', flush=True)\nwhile True:\n    pass")
    assert result.timed_out and result.killed_by == "SIGKILL" and result.exit_code is None
    assert result.output == "started\n"  # what it printed before the kill is kept
    assert result.seconds < short_sandbox.limits.wall_s + SLACK_S


@pytest.mark.slow
@needs_bwrap
def test_the_cpu_limit_ends_a_busy_process_with_sigxcpu():
    with Sandbox(SandboxLimits(wall_s=10.0, cpu_s=1), isolation="bwrap") as sandbox:
        result = sandbox.run("while True:\n    pass")
    assert (result.killed_by, result.timed_out) == ("SIGXCPU", False)


def test_a_fork_bomb_is_contained_and_leaves_nothing_behind(short_sandbox):
    result = short_sandbox.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert result.timed_out and result.seconds < short_sandbox.limits.wall_s + SLACK_S
    after = short_sandbox.run("import os\nprint(len([p for p in os.listdir('/proc') if p.isdigit()]))")
    assert after.output == "1\n"  # only itself (the worker is hidden): every process of the bomb is gone


def test_the_process_limit_holds_even_when_we_are_root(bwrap_sandbox):
    # Without a non-root uid outside, the kernel would ignore RLIMIT_NPROC and all 200 forks would succeed.
    code = ("import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
            "            time.sleep(10)\n            os._exit(0)\n        n += 1\nexcept BlockingIOError:\n    pass\nprint(n)")
    result = bwrap_sandbox.run(code)
    assert int(result.output) == bwrap_sandbox.limits.nproc - 1  # the call's own first process counts
    assert result.seconds < 2  # the sleeping children were killed at once, not waited for


def test_a_memory_bomb_fails_with_memory_error(short_sandbox):
    result = short_sandbox.run("x = b'1' * (2 << 30)")
    assert result.exit_code == 1 and "MemoryError" in result.output


def test_processes_together_cannot_exceed_the_memory_limit(bwrap_sandbox):
    # Each child is under RLIMIT_AS (512 MiB); three of them hold 900 MiB between them.
    code = ("import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        b = b'1' * (300 << 20)\n"
            "        time.sleep(10)\n        os._exit(0)\ntime.sleep(10)")
    result = bwrap_sandbox.run(code)
    assert (result.killed_by, result.timed_out) == ("SIGKILL", False)
    assert result.seconds < 3  # killed when the sum went over, not at the wall clock


def test_huge_output_is_capped_and_the_cut_counted(bwrap_sandbox):
    result = bwrap_sandbox.run("print('x' * 5_000_000)")
    cap = bwrap_sandbox.limits.output_bytes
    assert result.output == "x" * cap
    assert result.bytes_cut == 5_000_001 - cap
    assert result.exit_code == 0


def test_writing_outside_scratch_fails_and_the_host_file_is_not_created(bwrap_sandbox, tmp_path):
    target = tmp_path / "escaped.txt"
    code = (f"for path in ({str(target)!r}, '/usr/escaped', '/escaped', '/dev/escaped', '/proc/escaped'):\n"
            "    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n"
            "    except OSError as error:\n        print(type(error).__name__)")
    result = bwrap_sandbox.run(code)
    assert "WROTE" not in result.output and len(result.output.splitlines()) == 5
    assert not target.exists()


def test_a_loopback_listener_in_the_parent_is_unreachable(bwrap_sandbox):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                "    print('CONNECTED')\nexcept OSError as error:\n    print(type(error).__name__)\n"
                "print(open('/proc/net/tcp').read())")
        result = bwrap_sandbox.run(code)
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
    code = ("import os\nprint(sorted(os.environ))\n"
            f"for path in ({str(secret)!r}, '/proc/1/environ', '/etc/passwd', '/root', '/home', '/run'):\n"
            "    try:\n        print(open(path).read())\n    except OSError as error:\n"
            "        print(type(error).__name__)")
    with Sandbox(isolation="bwrap") as sandbox:  # started after the secret was set
        result = sandbox.run(code)
    assert "hunter2" not in result.output
    assert result.output.splitlines()[0] == "['HOME', 'LANG', 'PATH', 'PWD']"


def test_killing_the_parent_from_inside_fails(bwrap_sandbox):
    worker = bwrap_sandbox._worker.process.pid
    code = (f"import os, signal\nfor pid in (os.getppid(), {os.getpid()}, {worker}, -1):\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n        print('sent', pid)\n"
            "    except OSError as error:\n        print(type(error).__name__)")
    result = bwrap_sandbox.run(code)
    assert result.exit_code == 0  # kill(-1) was refused, or it would have killed the call itself
    os.kill(os.getpid(), 0)  # we are alive
    assert bwrap_sandbox.run("print('ok')").output == "ok\n"
    assert bwrap_sandbox._worker.process.pid == worker  # the same warm worker: pid 1 ignored the SIGKILL


def test_rejoining_or_making_namespaces_fails(bwrap_sandbox):
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "for ns in ('net', 'mnt', 'user', 'pid'):\n    for owner in ('1', 'self'):\n        try:\n"
            "            fd = os.open(f'/proc/{owner}/ns/{ns}', os.O_RDONLY)\n        except OSError as error:\n"
            "            print(ns, owner, 'open', error.errno)\n            continue\n"
            "        print(ns, owner, 'setns', libc.setns(fd, 0), ctypes.get_errno())\n"
            "print('unshare', libc.unshare(0x10000000 | 0x40000000), ctypes.get_errno())")
    lines = bwrap_sandbox.run(code).output.splitlines()
    assert len(lines) == 9
    assert all(line.endswith((" open 2", " -1 1")) for line in lines), lines  # pid 1 hidden, or EPERM


def test_deep_recursion_is_contained(short_sandbox):
    plain = short_sandbox.run("def f(n):\n    return f(n + 1)\nf(0)")
    assert plain.exit_code == 1 and "RecursionError" in plain.output
    unbounded = short_sandbox.run("import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)")
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
    result = bwrap_sandbox.run(f"import os\nos.kill(os.getpid(), {int(signal.SIGSEGV)})")
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
    code = ("import ctypes, os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(sorted(p for p in os.listdir('/proc') if p.isdigit()) == [str(os.getpid())])\n"
            "print('shmget', libc.shmget(0, 4096, 0o1600), ctypes.get_errno())\n"
            "print('mq_open', libc.mq_open(b'/note', 0o102, 0o600, None), ctypes.get_errno())\n"
            "try:\n    socket.socket(socket.AF_UNIX).bind('\\0note')\nexcept OSError as error:\n"
            "    print('abstract socket', error.errno)")
    assert bwrap_sandbox.run(code).output == "True\nshmget -1 1\nmq_open -1 1\nabstract socket 1\n"


def test_limits_cannot_be_raised_from_inside(bwrap_sandbox):
    code = ("import resource\nfor name in ('RLIMIT_NPROC', 'RLIMIT_AS', 'RLIMIT_CPU', 'RLIMIT_NOFILE'):\n"
            "    limit = getattr(resource, name)\n    try:\n"
            "        resource.setrlimit(limit, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
            "        print('RAISED', name)\n    except (ValueError, OSError):\n        print('refused')")
    assert bwrap_sandbox.run(code).output == "refused\n" * 4
