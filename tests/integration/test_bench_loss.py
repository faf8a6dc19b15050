"""benchmarks/loss.py: its inputs, and a --quick run end to end checked through its JSON, PNG and printed table.

Timings on a shared machine say nothing about which path is faster, so none is compared. What is asserted holds by
construction: both paths are timed for every T and dtype of --quick (T in {256, 1024}, float32 and bfloat16), the
ratio reported is the ratio of the two medians, and the benchmark's inputs make both paths do all their work, as its
docstring says: delta=1.0 admits every row (behavior is current plus 1e-3 noise), the base path keeps every policy
token, and the filter keeps ceil(0.9 T_i) in exactly the failed half of the rows.
"""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from flashreinforce import flashreinforce_loss
from bench_script import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "loss.py"
QUICK_WIDTHS = (256, 1024)
DTYPES = ("float32", "bfloat16")


def _load_script(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # the script imports benchmarks/machine.py as `machine`
    spec = importlib.util.spec_from_file_location("bench_loss", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPES)
def test_the_inputs_admit_every_row_and_the_filter_drops_tokens_of_failed_rows_only(monkeypatch, dtype):
    bench = _load_script(monkeypatch)
    inputs = bench.make_inputs(QUICK_WIDTHS[0], dtype)
    lengths = inputs["mask"].sum(-1)
    assert bool((lengths >= QUICK_WIDTHS[0] // 2).all()) and bool((lengths <= QUICK_WIDTHS[0]).all())
    failed = inputs["failures"]
    assert int(failed.sum()) == bench.BATCH // 2
    for fraction in (1.0, bench.FILTER_FRACTION):  # the two paths time_paths runs, with its arguments
        _, stats = flashreinforce_loss(inputs["current"], inputs["behavior"], inputs["rewards"], inputs["mask"],
                                       delta=1.0, negative_token_fraction=fraction, entropies=inputs["entropies"],
                                       failures=failed)
        assert float(stats["acceptance_rate"]) == 1.0, fraction  # no row rejected: no work skipped
        kept = torch.tensor([math.ceil(fraction * n) if f else n for n, f in zip(lengths.tolist(), failed.tolist())])
        assert torch.equal(stats["retained_tokens"], kept), fraction
    assert bool((kept[failed] < lengths[failed]).all())  # the filter path really filters


@pytest.mark.slow
def test_quick_run_times_both_paths_for_every_width_and_dtype(tmp_path):
    json_path, png = tmp_path / "loss.json", tmp_path / "loss.png"
    done = run_script(SCRIPT, "--quick", "--json", json_path, "--png", png, timeout=180, cwd=tmp_path)
    report = json.loads(json_path.read_text())
    assert (report["batch"], report["repeats"], report["warmup"]) == (128, 5, 1)  # --quick: median of 5 after 1
    assert {"cores", "load_average", "torch_threads", "busy"} <= set(report["machine"])
    rows = {(row["T"], row["dtype"]): row for row in report["results"]}
    assert len(report["results"]) == 4 and set(rows) == {(t, d) for t in QUICK_WIDTHS for d in DTYPES}
    for key, row in rows.items():
        assert row["base_ms"] > 0 and row["filter_ms"] > 0, key
        assert row["ratio_filter_over_base"] == pytest.approx(row["filter_ms"] / row["base_ms"], rel=1e-12), key
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = done.stdout.splitlines()
    for width in QUICK_WIDTHS:
        for dtype in DTYPES:
            for path in ("base", "filter q=0.9"):
                assert any(line.startswith(f"| {width} | {dtype} | {path} |") for line in table), (width, dtype, path)
