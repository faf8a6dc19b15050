"""Run untrusted Python (a model's tool calls) isolated: fresh process per call, hard limits, no network.

    from flashreinforce.sandbox import Sandbox, SandboxLimits
    with Sandbox(SandboxLimits(wall_s=5.0)) as sandbox:   # isolation="auto": the strongest level here
        result = sandbox.run("print(6 * 7)")             # SandboxResult(output="42\\n", exit_code=0, ...)

    records.py   SandboxLimits, SandboxResult, IsolationError     launch.py   the bwrap / unshare command lines
    sandbox.py   Sandbox, probe_isolation (the parent's side)     worker.py   the warm worker inside the sandbox
    syscalls.py  the seccomp filter (pyseccomp -> BPF)

Levels: "bwrap" (bubblewrap), "unshare" (util-linux, where bubblewrap is missing), "none" (limits and seccomp
only, and only with allow_unisolated=True). Linux only. It knows nothing about tools, prompts or rewards.
"""

from flashreinforce.sandbox.records import (
    LEVELS,
    PYTHON_TOOL_LIMITS,
    IsolationError,
    SandboxLimits,
    SandboxResult,
)
from flashreinforce.sandbox.sandbox import Sandbox, probe_isolation

__all__ = ["LEVELS", "PYTHON_TOOL_LIMITS", "IsolationError", "Sandbox", "SandboxLimits", "SandboxResult",
           "probe_isolation"]
