"""The Python tool environment: the model writes code in a tagged block, the sandbox runs it, its output
(capped) comes back as the observation; a turn without code is the final answer and ends the episode.

Each call runs in `flashreinforce.sandbox` (bubblewrap where available, else unshare; never unisolated
unless `allow_unisolated=True`). One warm sandbox per worker process serves every episode on it: a call is
stateless (fresh process, wiped scratch), so sharing it leaks nothing between episodes, and replaying an
episode's actions on a resume re-runs the same code to the same output.
"""

from __future__ import annotations

import re
from dataclasses import replace

from flashreinforce.envs.protocol import Observation, StepResult
from flashreinforce.sandbox import PYTHON_TOOL_LIMITS, Sandbox, SandboxResult
from flashreinforce.types import Prompt

_SANDBOXES: dict[tuple, Sandbox] = {}


def shared_sandbox(wall_s: float, memory_mb: int, output_bytes: int, allow_unisolated: bool) -> Sandbox:
    key = (wall_s, memory_mb, output_bytes, allow_unisolated)
    if key not in _SANDBOXES:
        limits = replace(PYTHON_TOOL_LIMITS, wall_s=wall_s, memory_mb=memory_mb, output_bytes=output_bytes)
        _SANDBOXES[key] = Sandbox(limits, allow_unisolated=allow_unisolated)
    return _SANDBOXES[key]


def tool_output(result: SandboxResult) -> str:
    """What the model reads back: the output, and a short note when the call did not end normally."""
    notes = []
    if result.timed_out:
        notes.append("timed out")
    elif result.over_memory:
        notes.append("killed: out of memory")
    elif result.killed_by:
        notes.append(f"killed by {result.killed_by}")
    elif result.exit_code:
        notes.append(f"exit code {result.exit_code}")
    if result.bytes_cut:
        notes.append(f"{result.bytes_cut} bytes cut")
    return result.output.rstrip("\n") + (f"\n[{', '.join(notes)}]" if notes else "")


class PythonToolEnv:
    """Options: the code tags, the observation's wrapping (`output_format` with {output}), `as_message`
    (a chat "tool" message instead of text), the sandbox's wall time / memory / output cap."""

    def __init__(self, open_tag: str = "<code>", close_tag: str = "</code>",
                 output_format: str = "<output>{output}</output>", as_message: bool = False,
                 wall_s: float = 5.0, memory_mb: int = 512, output_bytes: int = 4096,
                 allow_unisolated: bool = False) -> None:
        self.pattern = re.compile(re.escape(open_tag) + r"(.*?)" + re.escape(close_tag), re.DOTALL)
        self.output_format, self.as_message = output_format, as_message
        self.sandbox = shared_sandbox(wall_s, memory_mb, output_bytes, allow_unisolated)

    def reset(self, prompt: Prompt, seed: int) -> Observation:
        return ""  # the prompt is the task

    def step(self, action: str) -> StepResult:
        blocks = self.pattern.findall(action)
        if not blocks:
            return StepResult("", 0.0, True, {"tool_call": False})
        result = self.sandbox.run(blocks[-1])
        text = self.output_format.format(output=tool_output(result))
        observation = [{"role": "tool", "content": text}] if self.as_message else text
        return StepResult(observation, 0.0, False, {"tool_call": True, "exit_code": result.exit_code,
                                                    "timed_out": result.timed_out})

    def close(self) -> None:
        pass  # the shared sandbox outlives episodes; it dies with its worker process
