"""benchmarks/real_model.py: a --quick run (a tiny Llama from config) end to end, checked through its JSON.

Timings on a tiny model say nothing about SmolLM2; what is asserted holds by construction: every part and row is
there, the parts of a step add up to the step, the engine sampled every token asked for (run_engine checks), and
the fused decoding step sampled the model forward's tokens in fp32 and stays as close to the trainer's recompute as
the model's forward in bf16.
"""

import json
from pathlib import Path

import pytest
from bench_script import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "real_model.py"


@pytest.mark.slow
def test_quick_run_reports_the_machine_the_engine_the_trainer_and_packing(tmp_path):
    out = tmp_path / "real_model.json"
    run_script(SCRIPT, "--quick", "--json", out, timeout=300, cwd=SCRIPT.parent)
    report = json.loads(out.read_text())
    assert {row["shape"] for row in report["matmul"]} == {"decode MLP", "decode LM head", "trainer MLP",
                                                           "trainer LM head"}
    assert all(row["fp32"] > 0 and row["bf16"] > 0 for row in report["matmul"])
    methods = {row["method"]: row for row in report["engine"]}
    assert set(methods) == {f"{method} {precision}" for precision in ("fp32", "bf16")
                            for method in ("engine", "engine, model's forward", "generate")}
    assert all(row["best tok/s"] >= row["median tok/s"] > 0 for row in methods.values())
    agreement = {row["precision"]: row for row in report["fused_agreement"]}  # the tiny Llama is fused
    assert agreement["fp32"]["same tokens"] == agreement["fp32"]["requests"] == 8
    assert agreement["fp32"]["max log-prob gap"] <= 1e-5 and agreement["fp32"]["fused vs recompute, max"] <= 1e-5
    # bf16: the fused attention adds in its own order, a logit may differ by a bf16 rounding; the fused step stays
    # about as close to the trainer's recompute as the model's own forward (this quick run: means 2.8e-4, 2.4e-4)
    bf16 = agreement["bf16"]
    assert bf16["fused vs recompute, max"] <= 1e-2
    assert bf16["fused vs recompute, mean"] <= 2 * bf16["model's forward vs recompute, mean"] + 1e-4
    assert len(report["decode_split"]) == 4
    for split in report["decode_split"]:
        parts = ("matmul", "attention", "other model ops", "sampling", "bookkeeping")
        assert sum(split[p] for p in parts) == pytest.approx(split["ms/step"], rel=1e-6), split
        assert split["matmul"] > 0 and split["sampling"] > 0, split
    for step in report["trainer"]:
        parts = step["forward"] + step["backward"] + step["optimizer"] + step["other"]
        assert parts == pytest.approx(step["step"], rel=1e-6) and min(step["forward"], step["backward"]) > 0, step
    packing = {(row["precision"], row["microbatches"]): row for row in report["packing"]}
    assert set(packing) == {(p, m) for p in ("fp32", "bf16") for m in ("padded", "packed")}
    for precision in ("fp32", "bf16"):
        padded, packed = packing[precision, "padded"], packing[precision, "packed"]
        assert padded["packed / padded"] == 1.0 and packed["tokens/s"] > 0
        assert packed["packed / padded"] == pytest.approx(packed["tokens/s"] / padded["tokens/s"])
        assert 0 <= packed["padding fraction"] < 1 and 0 <= padded["padding fraction"] < 1
    assert "recipe" not in report  # --quick never starts a real run


@pytest.mark.slow
def test_quick_threads_part_steps_on_the_main_thread_and_a_worker_in_a_fresh_process(tmp_path):
    out = tmp_path / "threads.json"
    run_script(SCRIPT, "--quick", "--parts", "threads", "--precisions", "bf16", "--thread-counts", "1",
               "--json", out, timeout=300, cwd=SCRIPT.parent)
    steps = json.loads(out.read_text())["threads"]
    assert [step["thread"] for step in steps] == ["main"] * 3 + ["worker"] * 3 + ["main"] * 2 + [
        "main, worker gone"] * 2
    assert all(step["precision"] == "bf16" and step["torch threads"] == 1 and step["seconds"] > 0 for step in steps)
    # the pool's thread lives from the first worker step until it is shut down before the last two
    threads = [step["process threads after"] for step in steps]
    assert threads[3] == threads[2] + 1 and threads[-1] == threads[2], threads
