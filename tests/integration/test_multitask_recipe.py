"""The shipped `multitask` recipe end to end, cut down to a test's size: arithmetic (the math verifier), the
tool_multiply agent (python_tool episodes), the instructions task (the ifeval verifier) and a picture question (the
tiny model's encoder, the exact verifier) warm-started together and trained in one run, each reported on its own."""

import json

import pytest

from flashreinforce.config import load_config
from flashreinforce.run import run_training

pytestmark = pytest.mark.slow  # a whole run, ~30 s

SMALL = [
    "tasks.sums.data.arithmetic.num_train=200", "tasks.sums.data.arithmetic.num_eval=8",
    "tasks.tool.data.tool_multiply.num_train=100", "tasks.tool.data.tool_multiply.num_eval=8",
    "tasks.tool.env.max_workers=1",
    "tasks.follow.data.instructions.num_train=200", "tasks.follow.data.instructions.num_eval=8",
    "tasks.most.data.vision.num_train=100", "tasks.most.data.vision.num_eval=8",
    "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
    "sft.steps=20", "sft.batch_size=16",
    "rollout.max_batch_size=24", "scheduler.batch_groups=12",
    "trainer.steps=3", "trainer.microbatch_size=12", "trainer.checkpoint_every=3",
    "eval.num_prompts=4", "eval.k=1", "eval.every=3",
    "log.progress=false", "log.tensorboard=false", "verifier.min_workers=1", "verifier.max_workers=1",
]


def test_the_multitask_recipe_trains_its_four_tasks_and_reports_each(tmp_path):
    config = load_config("multitask", SMALL)
    assert {name: task.data.kind for name, task in config.task_list()} == {
        "sums": "arithmetic", "tool": "tool_multiply", "follow": "instructions", "most": "vision"}
    run = tmp_path / "run"
    summary = run_training(config, run_dir=run)
    assert summary["optimizer_steps"] == 3
    assert set(summary["tasks"]) == {"sums", "tool", "follow", "most"}
    assert all({"initial_accuracy", "final_accuracy"} <= set(scores) for scores in summary["tasks"].values())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/policy" in r]
    # Every task trained: its rows in the steps, in the weights' proportions over the run.
    trained = {name: sum(r.get(f"task/{name}/rows", 0) for r in steps) for name in ("sums", "tool", "follow", "most")}
    weights = {name: task.weight for name, task in config.task_list()}
    total = sum(trained.values())
    assert all(trained[name] > 0 for name in trained), trained
    assert all(abs(trained[name] / total - weights[name] / sum(weights.values())) < 0.1 for name in trained)
    # Turns are the agent's metric: in every step with tool rows (the stream may fill a step before a slower
    # episode ends), never for the single-turn tasks.
    assert any("task/tool/rows" in r for r in steps)
    assert all(("task/tool/turns" in r) == ("task/tool/rows" in r) and "task/follow/turns" not in r
               for r in steps)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {s["prompt_id"].split("/", 1)[0] for s in samples} <= {"sums", "tool", "follow", "most"}
    # The picture task's rows are image rows, the others text: per-modality metrics split them.
    assert any("modality/image/rows" in r for r in steps) and any("modality/text/rows" in r for r in steps)
    follow = [s for s in samples if s["prompt_id"].startswith("follow/")]
    assert all(s["reason"] == "ok" or s["reason"].startswith(("failed: ", "no_answer")) for s in follow)


@pytest.mark.reasoning_gym
def test_the_real_model_multitask_recipe_runs_a_step_of_both_tasks(tmp_path):
    """smollm2_multitask cut down: SmolLM2-135M-Instruct on reasoning-gym arithmetic and chat-message IFEval
    prompts; both tasks sampled, trained and evaluated with their own verifiers."""
    pytest.importorskip("reasoning_gym", reason="needs the reasoning-gym extra: pip install -e '.[reasoning-gym]'")
    from flashreinforce.models import store

    cached = store.find("smollm2-135m-instruct")
    if cached.problem is not None:
        pytest.skip(f"needs the converted model ({cached.path} {cached.problem}): run "
                    "`flashreinforce models get smollm2-135m-instruct` first")
    config = load_config("smollm2_multitask", [
        "tasks.arith.data.reasoning_gym.num_train=32", "tasks.arith.data.reasoning_gym.num_eval=4",
        "tasks.follow.data.instructions.num_train=32", "tasks.follow.data.instructions.num_eval=4",
        "scheduler.batch_groups=4", "rollout.max_batch_size=8", "rollout.max_new_tokens=24", "trainer.steps=1",
        "trainer.microbatch_size=4", "trainer.checkpoint_every=1", "eval.num_prompts=2", "log.progress=false",
        "log.tensorboard=false", "verifier.min_workers=1", "verifier.max_workers=1"])
    run = tmp_path / "run"
    summary = run_training(config, run_dir=run)
    assert summary["optimizer_steps"] == 1 and set(summary["tasks"]) == {"arith", "follow"}
    step = next(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "loss/policy" in line)
    assert step["task/arith/rows"] == 2 and step["task/follow/rows"] == 2
