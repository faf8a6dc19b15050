"""Child processes that must not outlive the process that started them (verifier workers, the trainer)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys


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
