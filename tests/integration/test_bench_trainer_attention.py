"""benchmarks/trainer_attention.py: its two arms really attend differently, and a --quick run end to end through its
JSON and printed table. Timings on a shared machine say nothing about which arm is faster, so none is compared."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from flashreinforce.models import token_logprobs
from flashreinforce.models.cpu_attention import FP32_SDPA
from bench_script import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "trainer_attention.py"


def _load_script(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # the script imports benchmarks/machine.py as `machine`
    spec = importlib.util.spec_from_file_location("bench_trainer_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_arms_are_the_switched_trainer_and_plain_bf16_sdpa(monkeypatch):
    bench = _load_script(monkeypatch)
    trainer, rows = bench.build("recipe", quick=True)
    model = trainer.model
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == FP32_SDPA
    ids = torch.tensor([list(rows[0].tokens)])
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        switched, _ = token_logprobs(model, ids, mask, temperature=1.0)
        model.set_attn_implementation("sdpa")
        plain, _ = token_logprobs(model, ids, mask, temperature=1.0)
    assert not torch.equal(switched, plain)  # the arm named "bf16 SDPA" is not the fp32 one again


@pytest.mark.slow
def test_quick_run_times_both_arms_of_both_models(tmp_path):
    json_path = tmp_path / "trainer_attention.json"
    done = run_script(SCRIPT, "--quick", "--json", json_path, timeout=300, cwd=tmp_path)
    report = json.loads(json_path.read_text())
    assert {"cores", "load_average", "torch_threads"} <= set(report["machine"])
    assert [r["model"] for r in report["results"]] == ["recipe", "smollm2"]
    for result in report["results"]:
        assert len(result["samples"][FP32_SDPA]) == len(result["samples"]["sdpa"]) == 1
        assert result["speedup"] == pytest.approx(result["bf16 SDPA step s"] / result["fp32 attention step s"])
        assert any(line.startswith(f"| {result['model']} | {result['rows']} |") for line in done.stdout.splitlines())


@pytest.mark.slow
def test_quick_kernels_run_times_every_shape_and_names_what_the_trainer_runs(tmp_path):
    from flashreinforce.models.cpu_attention import UPCAST_LIMIT

    json_path = tmp_path / "kernels.json"
    run_script(SCRIPT, "--kernels", "--quick", "--json", json_path, timeout=300, cwd=tmp_path)
    results = json.loads(json_path.read_text())["results"]
    assert len(results) == 12
    for r in results:
        assert r["bf16 ms"] > 0 and r["fp32 ms"] > 0
        assert r["trainer runs"] == ("fp32" if r["positions"] * r["head width"] <= UPCAST_LIMIT else "bf16"), r
