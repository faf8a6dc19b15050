"""benchmarks/sharding.py: replicated and FSDP-sharded trainer ranks side by side on a small model."""

import json
from pathlib import Path

import pytest
from bench_script import run_script

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sharding.py"


@pytest.mark.parametrize("lora", [0, pytest.param(4, marks=pytest.mark.long)])  # LoRA: out of CI's 45 minutes
def test_the_sharding_benchmark_measures_both_and_they_take_the_same_steps(tmp_path, lora):
    out = tmp_path / "bench"
    run_script(SCRIPT, "--hidden", "64", "--layers", "2", "--vocab", "256", "--length", "32", "--steps", "2",
               "--lora", lora, "--out", out, timeout=600)
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["sharding"] for r in runs] == ["replicate", "fsdp"]
    replicate, fsdp = runs
    assert fsdp["state_mb"] == pytest.approx(replicate["state_mb"] / 2)
    assert all(r["peak_rss_mb"] > r["anon_mb"] > 0 and r["step_seconds"] > 0 for r in runs)
    assert fsdp["max_weight_gap"] < 1e-5  # two optimizer steps of the same gradient, summed in another order
    table = (out / "table.md").read_text()
    shown = str(lora or "-")
    assert f"| replicate | {shown} | 2 |" in table and f"| fsdp | {shown} | 2 |" in table
    assert (out / "sharding.png").stat().st_size > 0
