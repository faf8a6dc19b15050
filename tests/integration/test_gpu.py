"""On a CUDA GPU (skipped elsewhere): the qwen_math recipe, brought down to a small chat model and the embedded
engine, trains a few steps with the trainer and the engine on the GPU, and the train/inference mismatch on the
same weights is measured for each precision; and each of the trainer's and the loop's paths (packed microbatches,
checkpointing, LoRA, minibatches, GRPO's groups, MoE route replay in bf16, agents, pictures, a distill pipeline)
runs its tests' tiny recipe with everything on the GPU, where a tensor left on the CPU fails.

Run them where a GPU is: `bash scripts/device_checks.sh` (it writes what each test measured to
$OUT/gpu_report.jsonl); `python -m pytest -q -m gpu` does the same without the report."""

import json
import math
import os
import time

import pytest
import torch

from conftest import AGENT_RUN, MIX_RUN, MOE_RUN, TINY_RUN, VISION_AGENT_RUN, VISION_RUN
from flashreinforce.config import load_config
from flashreinforce.run.training import run_training

pytestmark = [pytest.mark.slow, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/device_checks.sh)")]

SAME_WEIGHTS_FP32 = 1e-3
"""Largest |behavior - recomputed log-prob| on the same weights allowed in fp32 and in unified mode: the CPU
measures ~1e-5 at most; GPU attention kernels for one decoded token and for a whole row reduce in other orders."""


@pytest.fixture
def math_model(save_chat_model, tmp_path):
    """A 2-layer chat model (the offline ChatML tokenizer) and 64 addition prompts in the common RL format."""
    model_dir = save_chat_model(64, 2)
    rows = [{"prompt": [{"role": "user", "content": f"What is {a}+{b}? Answer with a number."}],
             "reward_model": {"ground_truth": str(a + b)}, "data_source": "add"}
            for a in range(8) for b in range(8)]
    data = tmp_path / "add.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return model_dir, data


def report(test: str, values: dict) -> None:
    """One JSON line of what a test measured, to $FLASHREINFORCE_GPU_REPORT when it is set."""
    path = os.environ.get("FLASHREINFORCE_GPU_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"test": test, "device": torch.cuda.get_device_name(), **values}) + "\n")


@pytest.mark.parametrize(("precision", "mode"), [("fp32", "separate"), ("bf16", "separate"), ("bf16", "unified")])
def test_the_qwen_math_recipe_trains_on_the_gpu(math_model, tiny_run, tmp_path, precision, mode):
    model_dir, data = math_model
    keep = [o for o in tiny_run if o.startswith(("log.", "verifier."))]
    config = load_config("qwen_math", [
        *keep, f"model.path={model_dir}", f"data.train={data}", f"data.eval={data}", "rollout.engine=local",
        "backend.kind=local", "trainer.device=cuda", "rollout.device=cuda", f"precision.trainer={precision}",
        f"precision.rollout={precision}", f"precision.mode={mode}", "rollout.max_new_tokens=24",
        "rollout.max_batch_size=32", "scheduler.batch_groups=16", "trainer.steps=4", "trainer.warmup_steps=0",
        "trainer.checkpoint_every=2", "trainer.microbatch_size=8", "eval.num_prompts=8", "eval.k=1", "eval.every=0"])
    run_dir = tmp_path / "run"
    summary = run_training(config, run_dir=run_dir)
    assert summary["optimizer_steps"] == 4 and summary["trained_trajectories"] == 64
    assert not summary["dropped_trajectories"]
    trained = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in trained if "loss/policy" in m]
    first = trained[0]  # sampled by the weights it trains (version 0): the engine-vs-trainer gap alone
    measured = {k: first[k] for k in first if k.startswith("mismatch/same_weights") or k == "mismatch/abs_logprob_diff"}
    report(f"qwen_math {precision} {mode}", {**measured, "train_seconds": first["time/train_seconds"]})
    assert measured["mismatch/same_weights_tokens"] > 0
    if precision == "fp32" or mode == "unified":
        assert measured["mismatch/same_weights_abs_max"] < SAME_WEIGHTS_FP32, measured
    assert all(torch.isfinite(torch.tensor(m["loss/policy"])) for m in trained)


ON_THE_GPU = ["trainer.device=cuda", "rollout.device=cuda"]
DISTILL = ("stages=[{name: warm, kind: sft, steps: 10}, {name: sums, steps: 2, tasks: {sums: {}}},"
           " {name: merge, kind: distill, from: warm, steps: 2, teachers: {sums: {stage: sums}, game: {stage: warm}}}]")
PATHS = {
    "default": ["arithmetic", *TINY_RUN],
    "packed": ["arithmetic", *TINY_RUN, "trainer.pack=true"],
    "checkpointed": ["arithmetic", *TINY_RUN, "trainer.gradient_checkpointing=true"],
    "lora": ["arithmetic", *TINY_RUN, "trainer.lora={r: 4, target_modules: all-linear}"],
    "minibatches": ["arithmetic", *TINY_RUN, "trainer.minibatches=2"],
    "grpo": ["arithmetic_grpo", *TINY_RUN],
    "lockstep": ["arithmetic", *TINY_RUN, "deterministic=true"],
    "moe_bf16_unified": ["arithmetic", *MOE_RUN],
    "text_game": AGENT_RUN,
    "mixture": ["arithmetic", *MIX_RUN],
    "vision": VISION_RUN,
    "visual_grid": VISION_AGENT_RUN,
    "distill": ["arithmetic", *MIX_RUN, DISTILL],
}


@pytest.mark.parametrize("path", list(PATHS))
def test_each_path_trains_with_everything_on_the_gpu(path, tmp_path):
    recipe, *overrides = PATHS[path]
    config = load_config(recipe, [*overrides, *ON_THE_GPU])
    started = time.perf_counter()
    run_training(config, run_dir=tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if any(key.startswith("loss/") for key in row)]
    report(f"path {path}", {"steps": len(trained), "seconds": round(time.perf_counter() - started, 1)})
    assert trained, "no optimizer step was logged"
    assert all(math.isfinite(value) for row in trained for key, value in row.items()
               if key.startswith("loss/") and isinstance(value, float))
