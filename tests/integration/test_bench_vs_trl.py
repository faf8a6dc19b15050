"""`benchmarks/vs_trl.py --quick`: the vs-TRL harness end to end, its four default methods (needs the trl extra);
the opt-in sync ablation's runs differ from the shipped recipe's in the scheduler alone."""

import json
import sys
from pathlib import Path

import pytest
from bench_script import run_script

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "vs_trl.py"


@pytest.mark.slow
@pytest.mark.long  # out of CI's 45 minutes (-m long runs it)
@pytest.mark.trl
def test_quick_runs_every_method_from_one_warm_start(tmp_path):
    pytest.importorskip("trl", reason="vs-trl runs TRL's GRPOTrainer: pip install 'flashreinforce[trl]'")
    report_path, png = tmp_path / "vs_trl.json", tmp_path / "vs_trl.png"
    # Threshold 0 is reached by the evaluation before RL: the to-threshold path runs too.
    done = run_script(BENCHMARK, "--quick", "--threshold", "0", "--out", tmp_path / "work", "--png", png, "--json",
                      report_path, timeout=600)
    assert "| TRL GRPOTrainer" in done.stdout and png.stat().st_size > 0
    assert "goal (FlashREINFORCE >= 1.5x as fast as the strongest TRL method" in done.stdout

    report = json.loads(report_path.read_text())
    settings = report["settings"]
    assert set(report["machine"]) >= {"cores", "load_average", "torch_threads", "busy"}
    assert report["machine"]["torch_threads"] == settings["threads"]
    runs = {run["method"]: run for run in report["runs"]}
    assert set(runs) == {"flashreinforce", "grpo", "trl", "trl-all-cores"}
    # TRL's two methods differ only in the threads they train with; their held-out evaluation keeps the runs'.
    assert runs["trl"]["threads"] == settings["threads"] and runs["trl-all-cores"]["threads"] == settings["all_cores"]
    assert report["strongest_trl"] in {"trl", "trl-all-cores"}
    assert set(report["ratios"][report["strongest_trl"]]) == {"flashreinforce", "grpo"}
    every = settings["eval_every"]
    for method, run in runs.items():
        assert run["steps"] == settings["steps"], method
        assert [p["step"] for p in run["points"]] == list(range(0, settings["steps"] + 1, every)), method
        seconds = [p["seconds"] for p in run["points"]]
        tokens = [p["sampled_tokens"] for p in run["points"]]
        assert seconds[0] == 0 and tokens[0] == 0 and seconds == sorted(seconds) and tokens == sorted(tokens)
        # Every trained trajectory holds at least its EOS; ours may also have sampled up to one engine's worth
        # of rollouts ahead (128 slots) within the 64-token budget.
        assert settings["steps"] * settings["trajectories"] <= run["sampled_tokens"], method
        assert run["sampled_tokens"] <= (settings["steps"] * settings["trajectories"] + 128) * 64, method
        # Tokens trained on: a subset of those sampled, every one for TRL (it trains on each batch it generates);
        # ours leaves out the batch generated ahead, so at the end it has trained on fewer than it sampled.
        trained = [p["trained_tokens"] for p in run["points"]]
        assert trained[0] == 0 and trained == sorted(trained), method
        assert trained[-1] >= settings["steps"] * settings["trajectories"], method
        assert all(t <= s for t, s in zip(trained, tokens)), method
        assert (trained == tokens) if method.startswith("trl") else (trained[-1] < tokens[-1]), method
        assert run["peak_rss_mb"] > 50 and run["peak_tree_rss_mb"] > 50, method
        assert report["summary"][method]["reached"] == 1 and report["summary"][method]["steps_to_threshold"] == [0]
    # One warm start, one evaluation: the same weights score the same before RL, whichever framework runs next.
    assert len({run["points"][0]["accuracy"] for run in runs.values()}) == 1
    assert runs["trl"]["points"][0]["accuracy"] == report["warm_start"]["eval/avg@k"]


def test_the_sync_ablation_is_flashreinforce_in_turns_and_runs_only_on_request(tmp_path):
    sys.path.insert(0, str(BENCHMARK.parent))
    try:
        from vs_trl import FULL
        from vs_trl_task import DEFAULT_METHODS, RECIPES, our_overrides
    finally:
        sys.path.remove(str(BENCHMARK.parent))
    from flashreinforce.config import load_config

    configs = {method: load_config(RECIPES[method], our_overrides(method, FULL, 0, tmp_path))
               for method in ("flashreinforce", "flashreinforce-sync")}
    overlapped, in_turns = configs["flashreinforce"], configs["flashreinforce-sync"]
    assert (overlapped.scheduler.kind, in_turns.scheduler.kind) == ("stream", "sync")
    # Everything else the same: one rollout of each of 128 prompts a step, the same objective and optimizer.
    assert in_turns.model_dump(exclude={"name", "scheduler"}) == overlapped.model_dump(exclude={"name", "scheduler"})
    assert (in_turns.scheduler.batch_groups, in_turns.scheduler.group_size) == (FULL.trajectories, 1)
    assert "flashreinforce-sync" not in DEFAULT_METHODS and "flashreinforce" in DEFAULT_METHODS
