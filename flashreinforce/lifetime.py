"""Child processes of a run (verifier and env workers, the trainer): how they start, that they die with it, and
how their errors and deaths are told."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from multiprocessing.connection import Connection
from pathlib import Path

_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


def start_child(module: str, *, env: Mapping[str, str] | None = None,
                new_session: bool = False) -> tuple[subprocess.Popen, Connection]:
    """Run `python -m module <fd> <our pid>` and return it with our end of a socket pair to it.

    A fresh interpreter, not a multiprocessing spawn (which re-runs the user's unguarded main script) nor a
    fork (which would copy the engine's threads mid-step). It imports this package from where we did, with
    `env` added to ours. The child reads its end as Connection(int(argv[1])) and should call
    die_with_parent(int(argv[2])) first. If it dies at once, the first send or receive on the connection fails.
    """
    parent, child = socket.socketpair()
    child_env = {**os.environ, **(env or {}),
                 "PYTHONPATH": os.pathsep.join([_PACKAGE_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
    with child:
        process = subprocess.Popen([sys.executable, "-m", module, str(child.fileno()), str(os.getpid())],
                                   pass_fds=(child.fileno(),), env=child_env, stdin=subprocess.DEVNULL,
                                   start_new_session=new_session)
    return process, Connection(parent.detach())


def die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when `parent_pid` dies, even in the middle of a call that never returns.

    The kernel signals when the thread that started this process exits, so start children from a thread
    that lives as long as they should.
    """
    if sys.platform != "linux":
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def describe_exit(returncode: int) -> str:
    """How a child ended, for a reason string: "exit code 3", "killed by SIGKILL"."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:  # a signal without a name (real-time signals)
        return f"killed by signal {-returncode}"


def describe_error(error: BaseException, limit: int = 300) -> str:
    """"Type: message" of an exception in user code, the message cut at `limit` characters (it travels in a
    reason string and a metric key prefix)."""
    message = str(error)
    if len(message) > limit:
        message = message[:limit] + "..."
    return f"{type(error).__name__}: {message}" if message else type(error).__name__
