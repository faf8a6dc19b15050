"""examples/toy_update.py runs end to end on the CPU: one batch, one step, loss and acceptance rate printed."""

import runpy
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "toy_update.py"


def test_toy_update_runs_and_reports(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--batch", "16", "--max-new-tokens", "8",
                                      "--negative-token-fraction", "0.9"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    # sampling and training share one model, so the gate admits every row
    assert "acceptance rate 1.000" in out and "loss " in out
