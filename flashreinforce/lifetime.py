"""Child processes of a run (verifier workers, the trainer): how they start, and that they die with it."""

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
