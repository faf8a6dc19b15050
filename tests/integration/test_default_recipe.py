"""The main job as a user runs it: `flashreinforce train` with no recipe, end to end (3-11 minutes on 2 cores,
depending on the CPU). How long it takes is measured and reported (README, docs/benchmarks.md), not asserted.

FLASHREINFORCE_DEFAULT_RUN=<run dir> checks a run already made by the README's first command as written (CI
runs it on a fresh clone, then points this test at its run directory) instead of running it again."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_default_recipe_learns_from_an_imperfect_warm_start(tmp_path):
    run_dir = Path(os.environ.get("FLASHREINFORCE_DEFAULT_RUN", tmp_path / "default"))
    if not (run_dir / "summary.json").is_file():
        subprocess.run([sys.executable, "-m", "flashreinforce", "train", "--output", str(run_dir)], check=True,
                       timeout=900)
    summary = json.loads((run_dir / "summary.json").read_text())
    # The warm start scored 49.6% when this bound was set, 50.1% with transformers 5.24, and 49.6-54.1% since,
    # by CPU (docs/benchmarks.md): imperfect either way, and the gain below is the point.
    assert 20 <= summary["initial_accuracy"] <= 55, "the warm start should be imperfect"
    # The overlapped loop is not bitwise reproducible: measured end points 70.9-78.1% (docs/benchmarks.md, "The
    # default recipe"). A fixed +20 failed by 0.9 points from a 54.1% warm start (an Intel CPU with AMX, whose
    # kernels round differently) at 73.2%, inside that range; RL that does not work stays near the warm start.
    assert summary["final_accuracy"] >= 70 and summary["final_accuracy"] >= summary["initial_accuracy"] + 15, summary
    assert summary["trained_trajectories"] == 300 * 128 and not summary["dropped_trajectories"]
    assert summary["recipe"] == "arithmetic"


@pytest.mark.slow
@pytest.mark.long  # ~6 minutes, out of CI's 45: CI checks the 2-rank step against one process and kills and
# resumes whole 2-rank runs (tests/integration/test_kill_resume.py)
def test_default_recipe_on_two_data_parallel_ranks_learns_as_well(tmp_path):
    """trainer.world_size=2: two gloo ranks in processes of their own train each batch's halves (the step
    equals the one-rank step: tests/unit/trainer/test_data_parallel.py); the recipe must learn as well."""
    run_dir = tmp_path / "dp"
    subprocess.run([sys.executable, "-m", "flashreinforce", "train", "trainer.world_size=2", "--output",
                    str(run_dir)], check=True, timeout=1200)
    summary = json.loads((run_dir / "summary.json").read_text())
    # the one-process run's bounds (above)
    assert summary["final_accuracy"] >= 70 and summary["final_accuracy"] >= summary["initial_accuracy"] + 15, summary
    assert summary["trained_trajectories"] == 300 * 128 and not summary["dropped_trajectories"]
