"""Hostile programs: the ones the sandbox's attack tests run (tests/unit/sandbox/), which the code verifier's
containment tests (tests/unit/verifiers/test_code_verifier.py) submit as responses. One copy, so that an attack
added here is tried both ways.

Each is what a model could write; the comment says what it would do if the isolation failed.
"""

from __future__ import annotations

import shutil
import signal

import pytest

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bwrap is not installed (apt-get install bubblewrap)")
needs_unshare = pytest.mark.skipif(shutil.which("unshare") is None,
                                   reason="unshare is not installed (apt-get install util-linux)")

INFINITE_LOOP = "print('started', flush=True)\nwhile True:\n    pass"
"""Runs forever: the wall clock must stop it (what it printed before is kept)."""

BUSY_LOOP = "while True:\n    pass"
"""Burns CPU: the CPU limit must end it."""

FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
"""Forks until the machine has no process slots left."""

SLEEPING_FORKS = ("import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
                  "            time.sleep(10)\n            os._exit(0)\n        n += 1\nexcept BlockingIOError:\n"
                  "    pass\nprint(n)")
"""Starts 200 sleeping processes and prints how many it got: the process limit must stop it short."""

MEMORY_BOMB = "x = b'1' * (2 << 30)"
"""Asks for 2 GiB at once."""

MEMORY_TOGETHER = ("import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        b = b'1' * (300 << 20)\n"
                   "        time.sleep(10)\n        os._exit(0)\ntime.sleep(10)")
"""Three processes of 300 MiB each: under the per-process limit (512 MiB) one by one, over it together."""

HUGE_OUTPUT = "print('x' * 5_000_000)"
"""5 MB of output, to fill the parent's memory."""

LEAVE_STATE = ("import os\nopen('left.txt', 'w').write('x')\nopen('/tmp/left.txt', 'w').write('x')\n"
               "open('/dev/shm/left', 'w').write('x')\nos.environ['LEFT'] = '1'\nprint(os.getcwd())")
"""Leaves files in scratch, /tmp and /dev/shm and a variable in its environment, for a later call to find."""

SEE_STATE = "import os\nprint(os.listdir('.'), os.listdir('/tmp'), os.listdir('/dev/shm'), os.environ.get('LEFT'))"
"""What an earlier call left: nothing, when calls share no state."""

COUNT_PROCESSES = "import os\nprint(len([p for p in os.listdir('/proc') if p.isdigit()]))"
"""How many processes it can see: only itself, when an earlier attack left nothing running."""

REJOIN_NAMESPACES = (
    "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "for ns in ('net', 'mnt', 'user', 'pid'):\n    for owner in ('1', 'self'):\n        try:\n"
    "            fd = os.open(f'/proc/{owner}/ns/{ns}', os.O_RDONLY)\n        except OSError as error:\n"
    "            print(ns, owner, 'open', error.errno)\n            continue\n"
    "        print(ns, owner, 'setns', libc.setns(fd, 0), ctypes.get_errno())\n"
    "print('unshare', libc.unshare(0x10000000 | 0x40000000), ctypes.get_errno())")
"""Joins the host's namespaces through the worker's (pid 1) /proc entries, or makes new ones of its own."""

DEEP_RECURSION = "def f(n):\n    return f(n + 1)\nf(0)"
UNBOUNDED_RECURSION = "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)"
"""Recursion with Python's limit lifted: it must end (stack or memory), not take the machine with it."""

SELF_SIGSEGV = f"import os\nos.kill(os.getpid(), {int(signal.SIGSEGV)})"
"""Dies of a signal: the ending must be named."""

KERNEL_OBJECTS = (
    "import ctypes, os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "print(sorted(p for p in os.listdir('/proc') if p.isdigit()) == [str(os.getpid())])\n"
    "print('shmget', libc.shmget(0, 4096, 0o1600), ctypes.get_errno())\n"
    "print('mq_open', libc.mq_open(b'/note', 0o102, 0o600, None), ctypes.get_errno())\n"
    "try:\n    socket.socket(socket.AF_UNIX).bind('\\0note')\nexcept OSError as error:\n"
    "    print('abstract socket', error.errno)")
"""Looks for the worker, and makes kernel objects that would outlive the call (a note for the next one)."""

RAISE_LIMITS = ("import resource\nfor name in ('RLIMIT_NPROC', 'RLIMIT_AS', 'RLIMIT_CPU', 'RLIMIT_NOFILE'):\n"
                "    limit = getattr(resource, name)\n    try:\n"
                "        resource.setrlimit(limit, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
                "        print('RAISED', name)\n    except (ValueError, OSError):\n        print('refused')")
"""Lifts its own limits."""


def write_outside(target: str) -> str:
    """Writes a host file, and into /usr, /, /dev and /proc; prints WROTE for each write that worked."""
    return (f"for path in ({target!r}, '/usr/escaped', '/escaped', '/dev/escaped', '/proc/escaped'):\n"
            "    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n"
            "    except OSError as error:\n        print(type(error).__name__)")


def connect_loopback(port: int) -> str:
    """Connects to a listener on the host's loopback, and lists the host's TCP sockets."""
    return (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    print('CONNECTED')\nexcept OSError as error:\n    print(type(error).__name__)\n"
            "print(open('/proc/net/tcp').read())")


def read_secrets(secret: str) -> str:
    """Prints its environment's names, then a host file, the worker's environment and system files."""
    return ("import os\nprint(sorted(os.environ))\n"
            f"for path in ({secret!r}, '/proc/1/environ', '/etc/passwd', '/root', '/home', '/run'):\n"
            "    try:\n        print(open(path).read())\n    except OSError as error:\n"
            "        print(type(error).__name__)")


def read_and_write_outside(secret: str, escaped: str) -> str:
    """Reads a host file and system files, then writes a host file, into /usr and into /."""
    return (f"for path in ({secret!r}, '/etc/passwd', '/root'):\n    try:\n        print(open(path).read())\n"
            "    except OSError as error:\n        print(type(error).__name__)\n"
            f"for path in ({escaped!r}, '/usr/escaped', '/escaped'):\n    try:\n"
            "        open(path, 'w')\n        print('WROTE', path)\n    except OSError as error:\n"
            "        print(type(error).__name__)")


def kill_parents(*pids: int) -> str:
    """SIGKILLs its parent, the given processes (the host's, the worker) and every process it may (-1)."""
    listed = ", ".join(str(pid) for pid in pids)
    return (f"import os, signal\nfor pid in (os.getppid(), {listed}, -1):\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n        print('sent', pid)\n"
            "    except OSError as error:\n        print(type(error).__name__)")
