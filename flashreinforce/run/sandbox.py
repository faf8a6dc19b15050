"""`flashreinforce sandbox FILE.py`: run one file exactly as the python tool runs a call, and show what it saw."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

from flashreinforce.sandbox import (
    PYTHON_TOOL_LIMITS,
    IsolationError,
    Sandbox,
    SandboxLimits,
)


def sandbox_limits(timeout: float | None = None, memory_mb: int | None = None) -> SandboxLimits:
    """The python tool's limits, with the command line's changes. The CPU limit follows --timeout (rounded up),
    so that a longer timeout is not cut short by the default CPU seconds."""
    limits = PYTHON_TOOL_LIMITS
    if timeout is not None:
        limits = dataclasses.replace(limits, wall_s=timeout, cpu_s=max(1, math.ceil(timeout)))
    if memory_mb is not None:
        limits = dataclasses.replace(limits, memory_mb=memory_mb)
    return limits


def run_sandbox_file(path: Path, *, timeout: float | None = None, memory_mb: int | None = None,
                     allow_unisolated: bool = False) -> int:
    """Print the call's output, then its status as one JSON line; the command's own exit status (0 = it ran,
    whatever the code did; 2 = no sandbox could run it)."""
    if not path.is_file():
        raise ValueError(f"no such file: {path}")
    try:
        code = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text: {error}") from None
    limits = sandbox_limits(timeout, memory_mb)
    try:
        with Sandbox(limits, allow_unisolated=allow_unisolated) as sandbox:
            print(f"flashreinforce sandbox: isolation {sandbox.level}, {limits}", file=sys.stderr)
            result = sandbox.run(code)
    except IsolationError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(result.output if not result.output or result.output.endswith("\n") else result.output + "\n")
    print(json.dumps(result.status()))
    return 0
