"""The command lines that start a worker at each isolation level, and the process settings that go with them.

Pure functions of the host's layout, so the tests can read the exact flags. What each level gives:

    bwrap    new user, pid, net, ipc, uts (and cgroup) namespaces; / is an empty read-only tmpfs holding
             /usr read-only (+ its /lib, /bin symlinks), /proc, a minimal /dev; no /etc, /home, /root, /run
    unshare  the same namespaces from util-linux `unshare`, and the same tree, built by the worker itself
    none     a plain process with the limits and the seccomp filter, seeing the host's files; opt-in only

At every level a root parent runs the sandbox as nobody (65534): the kernel never applies RLIMIT_NPROC to
uid 0, and inside a user namespace "root" is uid 0 unless the namespace maps it to someone else.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
ROOT_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
"""Top-level names that merged-/usr systems make symlinks into /usr; the sandbox copies those links."""


@dataclass(frozen=True)
class Launch:
    """Everything subprocess.Popen needs to start one worker."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    user: int | None  # run as this uid (and its gid), dropping root; None = as we are


def sandbox_python() -> str:
    """The interpreter the code runs on: one under /usr, since /usr is all the sandbox binds. Ours when our
    venv's base interpreter lives there, else the system's python3."""
    base = os.path.realpath(sys._base_executable)  # a venv's python is a link to its base interpreter
    for candidate in (base, "/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(candidate)
        if real.startswith("/usr/") and os.access(real, os.X_OK):
            return real
    raise FileNotFoundError("no Python under /usr for the sandbox (it binds only /usr): install python3")


def usr_links(root: str = "/") -> list[str]:
    """The top-level symlinks into /usr that this host has (lib -> usr/lib, ...)."""
    return [name for name in ROOT_LINKS if os.path.islink(Path(root, name))
            and os.readlink(Path(root, name)).lstrip("/").startswith("usr/")]


def worker_argv(python: str) -> list[str]:
    """`python3 -I -c <the worker's source>`: -I ignores PYTHON* variables and the user's site directory."""
    return [python, "-I", "-c", (Path(__file__).with_name("worker.py")).read_text()]


def _as_user() -> int | None:
    return NOBODY if os.geteuid() == 0 else None


def bwrap_launch(bwrap: str, python: str, links: list[str]) -> Launch:
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--hostname", "sandbox",
            # The worker is pid 1 (no bwrap reaper), so no process of a call can signal it; it dies with us.
            "--die-with-parent", "--new-session", "--as-pid-1",
            # Root of its own namespace only, mapped to us (or nobody) outside. It keeps the capabilities it
            # needs to mount /proc and each call's tmpfs, to take every capability from the call, and to see
            # every process of a call in /proc (to sum their memory), even one that made itself undumpable.
            "--uid", "0", "--gid", "0", "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP",
            "--cap-add", "CAP_SYS_PTRACE",
            "--clearenv", "--setenv", "PATH", SANDBOX_PATH, "--setenv", "HOME", "/scratch",
            "--setenv", "LANG", "C.UTF-8",
            "--ro-bind", "/usr", "/usr"]
    for name in links:
        argv += ["--symlink", os.readlink(f"/{name}"), f"/{name}"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--dir", "/tmp", "--dir", "/scratch", "--dir", "/.call",
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/", "--", *worker_argv(python)]
    return Launch(tuple(argv), env={}, cwd="/", user=_as_user())


def unshare_launch(unshare: str, python: str) -> Launch:
    # --kill-child: the worker gets SIGKILL when unshare dies, as bwrap's --die-with-parent does.
    argv = [unshare, "--user", "--map-root-user", "--mount", "--pid", "--fork", "--net", "--ipc", "--uts",
            "--kill-child", "--", *worker_argv(python)]
    return Launch(tuple(argv), env={"PATH": SANDBOX_PATH, "HOME": "/scratch", "LANG": "C.UTF-8"}, cwd="/",
                  user=_as_user())


def none_launch(python: str, scratch: str) -> Launch:
    env = {"PATH": SANDBOX_PATH, "HOME": scratch, "LANG": "C.UTF-8", "TMPDIR": scratch}
    return Launch(tuple(worker_argv(python)), env=env, cwd=scratch, user=_as_user())
