"""benchmarks/mismatch.py: a --quick run end to end, checked through its JSON, PNG and printed table.

The quick run's model is barely warm-started, so only facts that hold with a wide margin are asserted: every
row is there, fp32 on both sides agrees to float rounding, unified (fp32 compute on the same quantized weights)
beats separate bf16 kernels (by ~1000x in quick runs of seeds 0-2), and the benchmark's own recompute of pi_old
matches the trainer's metric. Router replay's max gap is only asserted not to exceed no replay's: where no route
flip reaches the worst token the two are equal (seed 1), otherwise replay's is lower (seeds 0 and 2: 4.6x, 2.3x).
"""

import json
from pathlib import Path

import pytest
from bench_script import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "mismatch.py"
MODELS = ("dense", "moe", "moe+replay")
EXPECTED_ROWS = {f"fp32 fp32 {model}" for model in MODELS} | {
    f"{precision} {mode} {model}"
    for precision in ("bf16", "fp8") for mode in ("rollout-only", "separate", "unified") for model in MODELS
}


@pytest.mark.slow
def test_quick_run_reports_every_row_and_the_orderings_that_hold_by_construction(tmp_path):
    json_path, png = tmp_path / "mismatch.json", tmp_path / "mismatch.png"
    done = run_script(SCRIPT, "--quick", "--json", json_path, "--png", png, timeout=240)
    report = json.loads(json_path.read_text())
    rows = {row["name"]: row for row in report["rows"]}
    assert len(EXPECTED_ROWS) == 21 and len(report["rows"]) == 21 and set(rows) == EXPECTED_ROWS
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = [line for line in done.stdout.splitlines() if line.startswith(("| fp32 |", "| bf16 |", "| fp8 |"))]
    assert len(table) == 21, done.stdout

    for name, row in rows.items():
        assert row["sampled_tokens"] > 0 and row["engine_tokens_per_second"] > 0 and row["train_seconds"] > 0, name
        assert 0 <= row["gate_acceptance"] <= 1 and 0 <= row["misc_acceptance"] <= 1, name
        assert row["gate_acceptance_tight"] <= row["gate_acceptance"], name  # a tighter delta admits no more rows
        assert (row["sequence_kl_max"] <= 3e-3) == (row["gate_acceptance"] == 1.0), name
        assert (row["route_disagreement"] is None) == (row["row"]["model"] == "dense"), name
        # the benchmark's no-grad recompute repeats the trainer's first forward: the same mean gap
        assert row["recompute_abs_mean"] == pytest.approx(row["same_weights_abs_mean"], rel=1e-4, abs=1e-9), name
    for model in MODELS:
        assert rows[f"fp32 fp32 {model}"]["same_weights_abs_max"] < 1e-4, model
        for precision in ("bf16", "fp8"):
            unified = rows[f"{precision} unified {model}"]["same_weights_abs_mean"]
            separate = rows[f"{precision} separate {model}"]["same_weights_abs_mean"]
            assert unified < separate, (precision, model, unified, separate)
    replay, plain = rows["bf16 rollout-only moe+replay"], rows["bf16 rollout-only moe"]
    assert replay["sampled_tokens"] == plain["sampled_tokens"]  # one engine setup: the very same rollouts
    assert replay["same_weights_abs_max"] <= plain["same_weights_abs_max"]
