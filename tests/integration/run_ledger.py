"""What the end-to-end fault tests read back from a run directory (imported by its siblings, as buffer_sim is)."""

import signal
import subprocess
import time
from pathlib import Path

from flashreinforce.buffer import Ledger
from flashreinforce.trainer.checkpoint import latest_checkpoint, load_states


def final_ledger(run_dir: Path) -> Ledger:
    """The ledger of the run's newest checkpoint, checked for internal consistency."""
    _, controller_state, _ = load_states(latest_checkpoint(run_dir / "checkpoints"))
    ledger = Ledger()
    ledger.load_state_dict(controller_state["scheduler"]["ledger"])
    ledger.check()
    return ledger


def kill_when(command: list[str], marker: Path, delay: float) -> int:
    """Start a run, SIGKILL it `delay` seconds after `marker` (a checkpoint, a stage's summary) appears; returns
    its pid."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert process.poll() is None, f"the run ended before {marker} appeared"
            assert time.monotonic() < deadline, f"{marker} did not appear"
            time.sleep(0.01)
        time.sleep(delay)
        assert process.poll() is None, "the run finished before the kill: lower the delay or add steps"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    return process.pid


_KILLED_AT_A_REPLACE = """
import os, signal, sys
target, when, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
replace, seen = os.replace, [0]

def aimed(source, destination, *args, **kwargs):
    hit = os.path.abspath(os.fspath(destination)) == target
    seen[0] += hit
    if hit and seen[0] == nth and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    result = replace(source, destination, *args, **kwargs)
    if hit and seen[0] == nth and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)
    return result

os.replace = aimed
from flashreinforce.cli import main
main(sys.argv[4:])
"""


def kill_at_replace(arguments: list[str], target: Path, *, when: str, nth: int = 1) -> None:
    """Run `flashreinforce ARGUMENTS` and SIGKILL it at the `nth` os.replace onto `target` (every file a run writes
    atomically is staged, then replaced into place): `before` it (the staged file written, the old one still
    there) or `after` it. Aimed exactly at a moment that polling for a marker file could only approach."""
    import sys

    process = subprocess.run([sys.executable, "-c", _KILLED_AT_A_REPLACE, str(target.absolute()), when, str(nth),
                              *arguments], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
    assert process.returncode == -signal.SIGKILL, (
        f"the run was to be killed at the {nth}th replace onto {target} ({when}); it exited {process.returncode}: "
        f"{process.stderr.decode()[-2000:]}")
