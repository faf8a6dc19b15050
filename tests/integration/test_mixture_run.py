"""A mixture of tasks end to end: arithmetic (single-turn, the math verifier) and the text game (an environment
and its reward) trained together, 3:1, each in its own way, with metrics and held-out scores per task."""

import json

import pytest

from flashreinforce.cli import main
from flashreinforce.config import load_config
from flashreinforce.run import run_training
from flashreinforce.trainer.checkpoint import latest_checkpoint, load_states

pytestmark = pytest.mark.slow  # a whole run, ~10 s


def test_a_mixture_trains_both_tasks_by_weight_and_reports_each(mix_run, tmp_path):
    """Under urb a step trains exactly the prompts at its positions of the mixed order: 6 + 2 of every 8."""
    run = tmp_path / "run"
    summary = run_training(load_config(None, [*mix_run, "scheduler.kind=urb"]), run_dir=run)
    assert summary["optimizer_steps"] == 3 and summary["trained_trajectories"] == 24
    assert set(summary["tasks"]) == {"sums", "game"}
    assert all({"initial_accuracy", "final_accuracy"} <= set(scores) for scores in summary["tasks"].values())
    # eval.num_prompts=4 of each task's held-out prompts: 8 scored in all
    assert [scores["eval_prompts"] for scores in summary["tasks"].values()] == [4, 4] and summary["eval_prompts"] == 8
    _, controller, _ = load_states(latest_checkpoint(run / "checkpoints"))
    trained = [prompt_id for prompt_id, _, status in controller["scheduler"]["ledger"]["entries"]
               if isinstance(status, int)]
    tasks = [prompt_id.split("/", 1)[0] for prompt_id in trained]
    assert len(tasks) == 24 and tasks.count("sums") == 18 and tasks.count("game") == 6  # 3:1
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/policy" in r]
    assert all((r["task/sums/rows"], r["task/game/rows"]) == (6, 2) for r in steps)
    assert all("task/game/turns" in r and "task/sums/turns" not in r for r in steps)  # episodes only in the game
    assert {"eval/task/sums/avg@k", "eval/task/game/avg@k"} <= set(rows[0])
    assert (run / "plots" / "task_reward.png").is_file() and (run / "plots" / "task_heldout_accuracy.png").is_file()
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    game = [s for s in samples if s["prompt_id"].startswith("game/")]
    assert all(s["reason"] in ("ok", "failed") for s in game)  # the environment's reward (env.reward=env)

    # `flashreinforce eval` scores each task's held-out prompts its own way; a file's rows need their task named
    main(["eval", str(run), "--k", "1", "--num-prompts", "2", "--json", str(tmp_path / "eval.json")])
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["num_prompts"] == 4 and {"eval/task/sums/avg@k", "eval/task/game/avg@k"} <= set(report)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "12+5=", "reward_model": {"ground_truth": "17"}}) + "\n")
    with pytest.raises(SystemExit):
        main(["eval", str(run), "--data", str(rows)])
    main(["eval", str(run), "--data", str(rows), "--task", "sums", "--k", "1", "--json", str(tmp_path / "file.json")])
    assert json.loads((tmp_path / "file.json").read_text())["num_prompts"] == 1


def test_tasks_sampling_at_different_temperatures_are_each_recomputed_at_their_own(tiny_run, tmp_path):
    """Task `cold` samples at 0.5 and `warm` at 1.0; the trainer recomputes each row's log-probs at its task's
    temperature, so the first (on-policy, fp32) step's mismatch between sampler and trainer is rounding for both.
    At one temperature for all, cold's rows would be off by the temperature (k3 of order 0.1, not 1e-6)."""
    arithmetic = "data: {kind: arithmetic, arithmetic: {num_train: 200, num_eval: 4}}"
    tasks = (f"tasks={{cold: {{{arithmetic}, rollout: {{temperature: 0.5}}}}, warm: {{{arithmetic}}}}}")
    overrides = [o for o in tiny_run if not o.startswith(("data.", "eval."))]
    run = tmp_path / "run"
    config = load_config(None, [tasks, *overrides, "deterministic=true", "trainer.steps=1", "eval.num_prompts=2",
                                "eval.k=1"])
    assert config.for_task("cold").rollout.temperature == 0.5 and config.for_task("warm").rollout.temperature == 1.0
    run_training(config, run_dir=run)
    first = next(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                 if "loss/policy" in line)
    assert first["task/cold/rows"] > 0 and first["task/warm/rows"] > 0
    assert first["task/cold/mismatch_k3_kl"] < 1e-4 and first["task/warm/mismatch_k3_kl"] < 1e-4, first
