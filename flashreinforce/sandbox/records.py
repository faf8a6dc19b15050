"""The sandbox's records: the limits a call runs under, what a call returned, and the error for a missing sandbox."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

LEVELS = ("bwrap", "unshare", "none")
"""Isolation levels, strongest first."""

HARD_OUTPUT_BYTES = 1 << 20
"""No configuration keeps more output than this per call: the parent holds every call's output in memory."""


class IsolationError(RuntimeError):
    """No sandbox of the asked-for strength could be started here; the message names the fix."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use. The defaults are the python tool's.

    The kernel enforces all but `wall_s` and `output_bytes` inside the sandbox, as hard limits the code cannot
    raise; the worker enforces `wall_s` and the parent both the output cap and a second, looser wall clock.
    """

    wall_s: float = 5.0
    """Wall-clock seconds before every process of the call is killed (timed_out=True)."""
    cpu_s: int = 4
    """CPU seconds per process: SIGXCPU at cpu_s, SIGKILL one second later."""
    memory_mb: int = 512
    """Address space per process, and resident memory of all the call's processes together."""
    output_bytes: int = 16384
    """stdout+stderr kept; the rest is dropped and counted in bytes_cut."""
    file_mb: int = 16
    """The most the code may write: per file, and in all of scratch, /tmp and /dev/shm together."""
    max_files: int = 64
    """Files the code may create, and file descriptors it may hold open at once."""
    nproc: int = 16
    """Processes and threads the code may run at once (its first process included)."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            whole = field.name != "wall_s"  # the kernel's limits take whole numbers
            if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) or not value > 0:
                kind = "a positive whole number" if whole else "a positive number of seconds"
                raise ValueError(f"SandboxLimits.{field.name} must be {kind}, got {value!r}")
        if self.output_bytes > HARD_OUTPUT_BYTES:
            raise ValueError(f"SandboxLimits.output_bytes={self.output_bytes} is over the hard cap of "
                             f"{HARD_OUTPUT_BYTES} bytes per call")
        if self.memory_mb < 64:
            raise ValueError(f"SandboxLimits.memory_mb={self.memory_mb}: a Python process needs at least 64 MiB "
                             "of address space to start")
        if self.max_files < 8:
            raise ValueError(f"SandboxLimits.max_files={self.max_files}: Python needs a few descriptors of its "
                             "own; give at least 8")


@dataclass(frozen=True)
class SandboxResult:
    """One call: its observation (stdout and stderr interleaved, as written) and how it ended."""

    output: str
    """At most output_bytes of stdout+stderr, decoded as UTF-8 with errors replaced."""
    exit_code: int | None
    """The exit status, or None when a signal ended the call."""
    timed_out: bool
    """The wall clock ran out and the call was killed."""
    killed_by: str | None
    """The signal that ended the call's first process ("SIGKILL", "SIGXCPU", "SIGSEGV", ...), or None."""
    over_memory: bool
    """The call's processes together went over memory_mb and were killed (SIGKILL)."""
    bytes_cut: int
    """Output bytes dropped by the cap (counted until the parent stops reading, at 16 MiB)."""
    seconds: float
    """Wall time of the call as the caller saw it."""
    isolation: str
    """The level the call ran at: "bwrap", "unshare" or "none"."""

    def status(self) -> dict:
        """Everything but the output: the one-line JSON after an observation."""
        return {"isolation": self.isolation, "exit_code": self.exit_code, "timed_out": self.timed_out,
                "killed_by": self.killed_by, "over_memory": self.over_memory, "bytes_cut": self.bytes_cut,
                "seconds": round(self.seconds, 4)}


PYTHON_TOOL_LIMITS = SandboxLimits()
"""The python tool's limits, which `flashreinforce sandbox FILE.py` also runs under."""
