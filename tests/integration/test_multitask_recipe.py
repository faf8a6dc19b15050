"""The shipped `multitask` recipe end to end, cut down to a test's size: arithmetic (the math verifier), the
tool_multiply agent (python_tool episodes) and the instructions task (the ifeval verifier) warm-started together
and trained in one run, each reported on its own."""

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
    "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
    "sft.steps=20", "sft.batch_size=16",
    "rollout.max_batch_size=24", "scheduler.batch_groups=12",
    "trainer.steps=3", "trainer.microbatch_size=12", "trainer.checkpoint_every=3",
    "eval.num_prompts=4", "eval.k=1", "eval.every=3",
    "log.progress=false", "log.tensorboard=false", "verifier.min_workers=1", "verifier.max_workers=1",
]


def test_the_multitask_recipe_trains_its_three_tasks_and_reports_each(tmp_path):
    config = load_config("multitask", SMALL)
    assert {name: task.data.kind for name, task in config.task_list()} == {
        "sums": "arithmetic", "tool": "tool_multiply", "follow": "instructions"}
    run = tmp_path / "run"
    summary = run_training(config, run_dir=run)
    assert summary["optimizer_steps"] == 3
    assert set(summary["tasks"]) == {"sums", "tool", "follow"}
    assert all({"initial_accuracy", "final_accuracy"} <= set(scores) for scores in summary["tasks"].values())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/policy" in r]
    # Every task trained: its rows in the steps, in the weights' proportions over the run.
    trained = {name: sum(r.get(f"task/{name}/rows", 0) for r in steps) for name in ("sums", "tool", "follow")}
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
    assert {s["prompt_id"].split("/", 1)[0] for s in samples} <= {"sums", "tool", "follow"}
    follow = [s for s in samples if s["prompt_id"].startswith("follow/")]
    assert all(s["reason"] == "ok" or s["reason"].startswith(("failed: ", "no_answer")) for s in follow)
