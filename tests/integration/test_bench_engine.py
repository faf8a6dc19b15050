"""benchmarks/engine.py: a --quick run end to end, checked through its JSON, PNG and printed table.

Which method is fastest depends on the machine's load, so no speedup or overhead is bounded. What is asserted holds
by construction: the run exits 0, so run_engine's own check passed (the engine sampled exactly every requested
token); all three methods count the same useful tokens, the workload's; each figure is what the report says it is
(tokens per second = useful tokens / seconds, speedup and overhead the ratios of those); and --quick's one batch
(requests = batch, short = 16: 7 in 8 rows want 12-20 tokens, 1 in 8 eight times as many) bounds the useful tokens
and makes generate, which runs every row to the longest, pad most of its batch.
"""

import json
from pathlib import Path

import pytest
from bench_script import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engine.py"
METHODS = ("generate", "engine", "bare")


@pytest.mark.slow
def test_quick_run_samples_every_requested_token_with_each_method(tmp_path):
    json_path, png = tmp_path / "engine.json", tmp_path / "engine.png"
    # a short engine run fails run_engine's assert
    done = run_script(SCRIPT, "--quick", "--json", json_path, "--png", png, timeout=300, cwd=tmp_path)
    report = json.loads(json_path.read_text())
    workload, methods = report["workload"], report["methods"]
    assert (report["model"]["hidden"], report["model"]["layers"]) == (64, 2) and report["model"]["parameters"] > 0
    assert workload["requests"] == workload["batch"]  # --quick: one batch
    requests, useful = workload["requests"], workload["useful_tokens"]
    longs = requests // 8  # i % 8 == 7
    assert (requests - longs) * 12 + longs * 8 * 12 <= useful <= (requests - longs) * 20 + longs * 8 * 20
    # one batch run to its longest row (>= 96 tokens) while 7 in 8 want <= 20: most of generate's tokens are padding
    assert 0.6 < workload["padding_fraction_generate"] < 1
    assert {"cores", "load_average", "torch_threads", "busy"} <= set(report["machine"])

    assert set(methods) == set(METHODS)
    for name, row in methods.items():
        assert row["useful_tokens"] == useful, name
        assert 0 < row["best_seconds"] == row["median_seconds"], name  # --quick runs each once
        assert row["tokens_per_second"] == pytest.approx(useful / row["best_seconds"], rel=1e-12), name
        assert row["median_tokens_per_second"] == pytest.approx(useful / row["median_seconds"], rel=1e-12), name
    engine = methods["engine"]
    assert 0 < engine["slot_utilization"] <= 1 and engine["full_batch_tokens_per_second"] > 0
    assert report["engine_speedup_vs_generate"] == pytest.approx(
        engine["tokens_per_second"] / methods["generate"]["tokens_per_second"], rel=1e-12)
    assert report["engine_overhead_vs_bare"] == pytest.approx(
        methods["bare"]["tokens_per_second"] / engine["tokens_per_second"], rel=1e-12)

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = done.stdout.splitlines()
    for name in METHODS:
        assert any(line.startswith(f"| {name} | {useful} |") for line in table), (name, done.stdout)
