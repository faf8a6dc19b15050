"""benchmarks/weight_sync.py: the Ray backend's weight pushes by the object store and by broadcast, side by side."""

import json
from pathlib import Path

import pytest
from bench_script import run_script

pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.ray]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "weight_sync.py"


def test_the_weight_sync_benchmark_times_both_paths_and_checks_the_engines(tmp_path):
    out = tmp_path / "bench"
    run_script(SCRIPT, "--hidden", "64", "--layers", "2", "--pushes", "2", "--repeats", "1", "--out", out,
               timeout=600)  # exits non-zero if an engine missed a push
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["weight_sync"] for r in runs] == ["object_store", "broadcast"]
    assert all(len(r["push_seconds"]) == 2 and min(r["push_seconds"]) > 0 for r in runs)
    assert runs[0]["parameters"] == runs[1]["parameters"] > 0
    table = (out / "table.md").read_text()
    assert "| object_store | 2 |" in table and "| broadcast | 2 |" in table
    assert (out / "weight_sync.png").stat().st_size > 0
