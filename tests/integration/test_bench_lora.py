"""benchmarks/lora.py: a --quick run end to end (the steps part and the pushes part, on the tiny model whatever is
cached), checked through its JSON and printed tables.

Step times and RSS of a tiny model say nothing about SmolLM2, so they are only checked to be there. What is asserted
holds by construction: full fine-tuning trains every parameter and LoRA a fraction; a process's high-water mark
(VmHWM) is at least its resident size at any reading; the merged push is the whole fp32 model, its tied weight
once (4 bytes per parameter, the same at every rank), while the adapter push carries only each adapted layer's A
and B (fp32), a scale and the probe: smaller than the merged push, and from rank 4 to rank 8 it grows by exactly
the 4 more ranks' A and B, as many as the rank-4 LoRA of the steps part trains.
"""

import json
from pathlib import Path

import pytest
from bench_script import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lora.py"
FP32 = 4  # bytes


@pytest.mark.slow
@pytest.mark.lora
def test_quick_run_steps_full_and_lora_and_the_adapter_push_is_the_smaller(tmp_path):
    json_path = tmp_path / "lora.json"
    done = run_script(SCRIPT, "--quick", "--json", json_path, timeout=300, cwd=tmp_path)
    report = json.loads(json_path.read_text())
    settings = report["settings"]
    assert settings["quick"] and settings["r"] == 4 and settings["push_ranks"] == "4,8"  # the steps part's rank

    steps = {row["method"]: row for row in report["rows"]}
    assert len(report["rows"]) == 2 and set(steps) == {"full", "lora"}  # --quick: the mmap allocator only
    full, lora = steps["full"], steps["lora"]
    assert full["model"].startswith("tiny") and full["params"] == lora["params"] > 0
    assert full["trainable_params"] == full["params"] > lora["trainable_params"] > 0
    for method, row in steps.items():
        assert row["allocator"] == "mmap" and len(row["step_times"]) == settings["repeats"], method
        assert row["step_seconds"] > 0 and row["first_step_seconds"] > 0 and row["push_seconds"] > 0, method
        assert row["peak_rss_mb"] >= max(row["rss_at_end_mb"], row["rss_after_build_mb"]) > 0, method
    table = done.stdout.splitlines()
    assert any(line.startswith("| full | mmap |") for line in table) and any(
        line.startswith("| lora | mmap |") for line in table), done.stdout

    pushes = {(row["r"], row["push"]): row for row in report["pushes"]}
    assert len(report["pushes"]) == 4 and set(pushes) == {(r, p) for r in (4, 8) for p in ("merged", "adapter")}
    for key, row in pushes.items():
        assert row["trainer s"] > 0 and row["engine s"] > 0, key
        assert row["push s"] == pytest.approx(row["trainer s"] + row["engine s"], rel=1e-12), key
    merged_bytes = {r: pushes[r, "merged"]["MB"] * 2**20 for r in (4, 8)}
    adapter_bytes = {r: pushes[r, "adapter"]["MB"] * 2**20 for r in (4, 8)}
    assert merged_bytes[4] == merged_bytes[8] == FP32 * full["params"]  # parameters() lists a tied weight once too
    assert all(adapter_bytes[r] < merged_bytes[r] for r in (4, 8)), (adapter_bytes, merged_bytes)
    # trainable params at rank 4 = 4 x (in + out) summed over the adapted layers: 4 ranks' worth of A and B
    assert adapter_bytes[8] - adapter_bytes[4] == FP32 * lora["trainable_params"] * (8 - 4) / settings["r"]
    assert sum(line.startswith(("| 4 | ", "| 8 | ")) for line in table) == 4, done.stdout
