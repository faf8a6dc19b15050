"""Run untrusted Python in a warm sandbox: `Sandbox(limits).run(code) -> SandboxResult`, a fresh process per call.

The parent's side. It starts one worker per Sandbox inside the sandbox (see worker.py for what happens in
there), hands it each call's code and an output pipe, reads the output itself (capped), and keeps its own
wall clock a little past the worker's: a worker that does not answer in time is killed with its whole
sandbox, and the next call starts a fresh one. It knows nothing about tools or tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from typing import TYPE_CHECKING

from flashreinforce.sandbox.launch import (
    NOBODY,
    Launch,
    bwrap_launch,
    none_launch,
    sandbox_python,
    unshare_launch,
    usr_links,
)
from flashreinforce.sandbox.records import (
    LEVELS,
    PYTHON_TOOL_LIMITS,
    IsolationError,
    SandboxLimits,
    SandboxResult,
)
from flashreinforce.sandbox.syscalls import seccomp_program
from flashreinforce.sandbox.worker import FRAME_BYTES, parse_frame, send_frame

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11; the project supports 3.10

log = logging.getLogger(__name__)

SLACK_S = 2.0
"""The parent waits this long past wall_s for the worker's answer before it kills the whole sandbox."""
START_S = 10.0
DRAIN_BYTES = 16 << 20
"""Output past the cap is read and counted up to here, then the pipe is closed (writes fail with EPIPE)."""
OPT_IN = ("allow_unisolated=True (the python_tool environment: env.options.allow_unisolated=true; the "
          "command: `flashreinforce sandbox --allow-unisolated`)")


@dataclasses.dataclass
class _Collected:
    """What the parent gathered during one call."""

    kept: bytearray = dataclasses.field(default_factory=bytearray)
    cut: int = 0
    reply: dict | None = None
    ended: str = "answered"  # or "died" (the worker closed the socket) or "late" (it did not answer in time)


class _WorkerGone(Exception):
    """The worker died before it took the call: the code never ran, so a fresh worker may run it."""


class _Worker:
    """One running worker: its process, our end of its control socket, and the none level's scratch."""

    def __init__(self, level: str) -> None:
        self.level = level
        program = _program(level)  # everything that can refuse comes before anything is started
        plan, self.scratch = _plan(level)
        self.socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115 - the worker's stderr for as long as it lives
        self.process = None
        dropped = {} if plan.user is None else {"user": plan.user, "group": plan.user, "extra_groups": []}
        try:
            with theirs:
                self.process = subprocess.Popen(plan.argv, stdin=theirs, stdout=subprocess.DEVNULL,
                                                stderr=self.errors, env=plan.env, cwd=plan.cwd,
                                                start_new_session=True, **dropped)
            send_frame(self.socket, {"level": level, "program": program.hex(), "usr_links": usr_links(),
                                     "scratch": self.scratch})
            reply, ended = _answer(self.socket, time.monotonic() + START_S)
        except OSError as error:  # it could not be started, or died before reading its first frame
            reply, ended = None, f"{type(error).__name__}: {error}"
        if reply != {"ready": True}:
            self.close()
            raise IsolationError(f"the {level} sandbox did not start ({ended}): {self.stderr() or reply}")

    def alive(self) -> bool:
        return self.process.poll() is None

    def call(self, code: str, limits: SandboxLimits) -> SandboxResult:
        start = time.monotonic()
        code_fd = os.memfd_create("sandbox-code")
        out_read, out_write = os.pipe()
        try:
            _write_all(code_fd, code.encode("utf-8", "surrogatepass"))
            send_frame(self.socket, {"limits": dataclasses.asdict(limits)}, (code_fd, out_write))
        except OSError as error:
            os.close(out_read)
            self.kill()
            raise _WorkerGone(str(error)) from error
        finally:
            os.close(code_fd)
            os.close(out_write)  # the child holds the only write end now: EOF means every writer is gone
        got = _collect(self.socket, out_read, limits, start + limits.wall_s + SLACK_S)
        status = _status(got.reply) if got.ended == "answered" else None
        if status is None:
            self.kill()  # dead, late, or talking nonsense: nothing it says can be trusted; start afresh
            status = {"exit_code": None, "killed_by": "SIGKILL", "timed_out": got.ended == "late",
                      "over_memory": False}
        return SandboxResult(output=bytes(got.kept).decode("utf-8", errors="replace"), bytes_cut=got.cut,
                             seconds=time.monotonic() - start, isolation=self.level, **status)

    def stderr(self) -> str:
        self.errors.seek(0)
        return self.errors.read()[-4000:].decode("utf-8", errors="replace").strip()

    def kill(self) -> None:
        """SIGKILL the worker's process group: the namespaces go with it (--die-with-parent, --kill-child)."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def close(self) -> None:
        self.kill()
        self.socket.close()
        self.errors.close()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def _plan(level: str) -> tuple[Launch, str | None]:
    """How to start the level's worker, and the none level's scratch directory (made last: nothing to leak)."""
    try:
        python = sandbox_python()
    except FileNotFoundError as error:
        raise IsolationError(str(error)) from error
    if level == "none":
        scratch = tempfile.mkdtemp(prefix="flashreinforce-sandbox-")
        if os.geteuid() == 0:
            os.chown(scratch, NOBODY, NOBODY)  # the worker runs as nobody
        return none_launch(python, scratch), scratch
    tool = shutil.which(level)
    if tool is None:
        fix = "apt-get install bubblewrap" if level == "bwrap" else "apt-get install util-linux"
        raise IsolationError(f"{level} is not installed ({fix})")
    if level == "bwrap":
        return bwrap_launch(tool, python, usr_links()), None
    return unshare_launch(tool, python), None


def _program(level: str) -> bytes:
    """The seccomp BPF; the none level runs without one where libseccomp is missing (it is opt-in anyway)."""
    try:
        return seccomp_program()
    except IsolationError:
        if level != "none":
            raise
        log.warning("no libseccomp: the unisolated sandbox runs without a seccomp filter")
        return b""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _answer(sock: socket.socket, deadline: float) -> tuple[dict | None, str]:
    """One frame from the worker by the deadline: (message, "answered") or (None, "died" | "late")."""
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([sock], [], [], left)[0]:
        return None, "late"
    try:
        message = parse_frame(sock.recv(FRAME_BYTES))  # any descriptors it sent are dropped by the kernel
    except (OSError, ValueError, TypeError):  # a closed socket, or not one JSON object
        return None, "died"
    return message, "answered" if message is not None else "died"


def _collect(sock: socket.socket, out_read: int, limits: SandboxLimits, deadline: float) -> _Collected:
    """Read the call's output (keeping limits.output_bytes) until the worker has answered and the pipe is shut."""
    got = _Collected()
    try:
        while out_read is not None or got.reply is None:
            waiting = [fd for fd in (out_read, sock if got.reply is None else None) if fd is not None]
            ready = select.select(waiting, [], [], max(0.0, deadline - time.monotonic()))[0]
            if not ready:
                got.ended = "late"
                return got
            if sock in ready:
                got.reply, got.ended = _answer(sock, deadline)
                if got.reply is None:
                    return got
            if out_read in ready:
                chunk = os.read(out_read, 1 << 16)
                room = limits.output_bytes - len(got.kept)
                got.kept += chunk[:room]
                got.cut += max(0, len(chunk) - room)
                if not chunk or len(got.kept) + got.cut >= DRAIN_BYTES:
                    os.close(out_read)
                    out_read = None
        return got
    finally:
        if out_read is not None:
            os.close(out_read)


def _status(reply: dict | None) -> dict | None:
    """The result fields from the worker's answer, or None when the answer is not one."""
    if not isinstance(reply, dict):
        return None
    exit_code, number, ending = reply.get("exit_code"), reply.get("signal"), reply.get("ending")
    if not (isinstance(exit_code, (int, type(None))) and isinstance(number, (int, type(None)))
            and ending in ("exited", "timeout", "memory")):
        return None
    try:
        killed_by = None if number is None else signal.Signals(number).name
    except ValueError:
        killed_by = f"signal {number}"
    return {"exit_code": exit_code, "killed_by": killed_by, "timed_out": ending == "timeout",
            "over_memory": ending == "memory"}


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[str, tuple[str, ...]]:
    """The strongest level that starts here and runs a call correctly, and why each stronger one did not."""
    reasons = []
    for level in LEVELS[:-1]:
        try:
            worker = _Worker(level)
        except IsolationError as error:
            reasons.append(f"{level}: {error}")
            continue
        try:
            result = worker.call("print(6 * 7)", PYTHON_TOOL_LIMITS)
        finally:
            worker.close()
        if result.output == "42\n" and result.exit_code == 0:
            return level, tuple(reasons)
        reasons.append(f"{level}: a test call printed {result.output!r} and exited with {result.exit_code}")
    return "none", tuple(reasons)


def probe_isolation() -> str:
    """"bwrap", "unshare" or "none": the strongest isolation that works here, found by trying (once a process)."""
    return _probe()[0]


def choose_level(isolation: str, allow_unisolated: bool) -> str:
    if isolation not in ("auto", *LEVELS):
        raise ValueError(f"isolation must be 'auto' or one of {LEVELS}, got {isolation!r}")
    if isolation == "auto":
        level, reasons = _probe()
        if level == "none" and not allow_unisolated:
            raise IsolationError("no sandbox works on this machine (" + "; ".join(reasons) + "). Install "
                                 f"bubblewrap (apt-get install bubblewrap), or opt in to unisolated runs with {OPT_IN}")
        return level
    if isolation == "none" and not allow_unisolated:
        raise IsolationError(f"isolation='none' runs untrusted code with no sandbox; opt in with {OPT_IN}")
    return isolation


class Sandbox:
    """A warm sandbox: one worker at the chosen level, one fresh process per `run`, calls one at a time.

    The worker dies with the thread that started it (bubblewrap's --die-with-parent follows the kernel's
    parent-death signal, which is per thread); `run` then starts a fresh one, as after any worker death.
    """

    def __init__(self, limits: SandboxLimits = PYTHON_TOOL_LIMITS, isolation: str = "auto",
                 allow_unisolated: bool = False) -> None:
        self._worker: _Worker | None = None  # first, so that __del__ works whatever __init__ raises
        self.limits = limits
        self.level = choose_level(isolation, allow_unisolated)
        if self.level == "none":
            log.warning("sandbox: running untrusted code unisolated (isolation='none', opted in)")
        self._lock = threading.Lock()
        self._closed = False
        self._worker = _Worker(self.level)

    def run(self, code: str) -> SandboxResult:
        """Run `code` as `python3 -c code` would, in a fresh process, under self.limits."""
        with self._lock:
            if self._closed:
                raise ValueError("this Sandbox is closed")
            if self._worker is not None and self._worker.alive():
                try:
                    return self._worker.call(code, self.limits)
                except _WorkerGone:
                    pass  # it died between calls (its starting thread ended, or it was killed): start afresh
            if self._worker is not None:
                self._worker.close()
            self._worker = None  # if the restart fails, the next run tries again
            self._worker = _Worker(self.level)
            try:
                return self._worker.call(code, self.limits)
            except _WorkerGone as error:
                raise IsolationError(f"a fresh {self.level} sandbox died before it took the call: "
                                     f"{self._worker.stderr() or error}") from error

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._worker is not None:
                self._worker.close()
                self._worker = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if self._worker is not None:
            self._worker.close()
