"""What the end-to-end fault tests read back from a run directory (imported by its siblings, as buffer_sim is)."""

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
