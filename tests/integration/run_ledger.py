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
