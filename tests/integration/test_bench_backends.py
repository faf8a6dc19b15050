"""benchmarks/backends.py: the Ray and local backends side by side on a small default-recipe run."""

import json
from pathlib import Path

import pytest
from bench_script import run_script

pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.ray]  # long: out of CI's 45 minutes (-m long)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "backends.py"


def test_the_backends_benchmark_times_both_backends(tmp_path):
    out = tmp_path / "bench"
    run_script(SCRIPT, "--steps", "4", "--out", out, "sft.steps=20", "eval.num_prompts=16", "eval.greedy=false",
               "scheduler.batch_groups=16", timeout=600)
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["backend"] for r in runs] == ["local", "ray"]
    for run in runs:
        assert run["steps"] == 4 and run["rl_seconds"] > 0 and run["step_ms_median"] > 0
        assert run["wall_seconds"] > run["rl_seconds"]
    table = (out / "table.md").read_text()
    assert "| local | 0 |" in table and "| ray | 0 |" in table and (out / "backends.png").stat().st_size > 0
