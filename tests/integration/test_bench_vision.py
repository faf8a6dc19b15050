"""benchmarks/vision.py: a --quick run of two seeds end to end, checked through its JSON and its table."""

import json
from pathlib import Path

import pytest
from bench_script import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vision.py"


@pytest.mark.slow
def test_quick_run_reports_each_seed_and_each_task(tmp_path):
    report = tmp_path / "report.json"
    done = run_script(SCRIPT, "--quick", "--seeds", "0", "1", "--out", tmp_path, "--json", report, timeout=600)
    runs = json.loads(report.read_text())["runs"]
    assert [run["seed"] for run in runs] == [0, 1]
    for run in runs:
        assert set(run["tasks"]) == {"count", "tallest", "most"}
        assert all(0 <= v <= 100 for pair in run["tasks"].values() for v in pair)
        assert 0 <= run["before"] <= 100 and 0 <= run["after"] <= 100 and run["wall_seconds"] > 0
        assert run["dropped"] == 0
    for seed in (0, 1):  # each seed ran as its own recipe run
        assert (tmp_path / f"seed{seed}" / "summary.json").is_file()
        assert f"seed: {seed}" in (tmp_path / f"seed{seed}" / "config.yaml").read_text()
    assert "| seed | held-out before → after |" in done.stdout
