"""benchmarks/schedulers.py: its KS statistic, and a --quick run end to end checked through its JSON."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats  # in the test extra; the benchmark itself does without it
from bench_script import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "schedulers.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_schedulers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_ks_statistic_by_hand_and_against_scipy():
    ks = _load_script().ks_statistic
    assert ks([1, 2], [2, 3]) == 0.5  # F_a - F_b at 1, 2, 3: 1/2, 1/2, 0
    assert ks([3, 1, 2], [2, 3, 1]) == 0.0
    assert ks([1, 1], [5]) == 1.0
    # ties across samples: F_a(2) = 3/4, F_b(2) = 1/4
    assert ks([1, 2, 2, 9], [2, 5, 5, 5]) == 0.5
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 6, 300), rng.integers(1, 7, 200)  # discrete: many ties
    assert ks(a, b) == pytest.approx(stats.ks_2samp(a, b).statistic, abs=1e-12)


def _run(out: Path, *args: str) -> dict:
    json_path = out / f"report{len(list(out.glob('report*.json')))}.json"
    run_script(SCRIPT, "--quick", "--out", out, "--json", json_path, *args, timeout=300)
    return json.loads(json_path.read_text())


@pytest.mark.slow
@pytest.mark.long  # out of CI's 45 minutes (-m long runs it)
def test_quick_run_reports_every_kind_and_urb_trains_exactly_its_data_group(tmp_path):
    report = _run(tmp_path)
    settings = report["settings"]
    steps, batch = settings["steps"], settings["batch"]
    # urb and stream at each default lag bound (1, 2), sync and april once
    assert set(report["kinds"]) == {"sync", "april", "urb lag<=1", "urb lag<=2", "stream lag<=1", "stream lag<=2"}
    assert {"cores", "load_average", "torch_threads", "busy"} <= set(report["machine"])
    assert Path(report["png"]).is_file() and not report["warm_start"]["reused"]
    for kind, row in report["kinds"].items():
        (run,) = row["runs"]
        assert len(run) == steps and all(len(s["lengths"]) == batch for s in run), kind
        assert row["steps_per_second"] > 0 and 0 < row["slot_utilization"] <= 1, (kind, row)
        assert 0 <= row["ks_difficulty_vs_sync"] <= 1 and 0 <= row["ks_length_vs_sync"] <= 1, (kind, row)
    # sync and urb train exactly D_t = data positions [t*B, (t+1)*B) at step t: no difficulty bias at all
    for kind in ("sync", "urb lag<=1", "urb lag<=2"):
        for t, s in enumerate(report["kinds"][kind]["runs"][0]):
            assert sorted(s["positions"]) == list(range(t * batch, (t + 1) * batch)), (kind, t)
        assert report["kinds"][kind]["ks_difficulty_vs_sync"] == 0.0
        assert report["kinds"][kind]["ks_difficulty_vs_data"] == 0.0
        assert report["kinds"][kind]["off_step_fraction"] == 0.0
    # april trains whatever finished first: some prompts leave their data step
    assert report["kinds"]["april"]["off_step_fraction"] > 0
    for kind, row in report["kinds"].items():
        assert 0 < row["decode_ms"] < 1000, (kind, row)
    assert report["kinds"]["sync"]["lag_max"] == 0 and report["kinds"]["sync"]["ks_length_vs_sync"] == 0.0
    for lag in (1, 2):  # urb N = lag + 1, stream S = lag: the bound holds, and each ran with its own engine size
        for kind in ("urb", "stream"):
            row = report["kinds"][f"{kind} lag<={lag}"]
            assert (row["kind"], row["max_lag"]) == (kind, lag) and row["lag_max"] <= lag, row
        assert report["settings"]["config_by_lag"][str(lag)]["rollout"]["max_batch_size"] == batch * (lag + 1)
    assert report["kinds"]["urb lag<=2"]["lag_max"] == 2  # the looser bound is used, not just allowed
    assert report["kinds"]["sync"]["speedup_vs_sync"] == 1.0

    again = _run(tmp_path, "--kinds", "sync", "--steps", "2", "--trainer", "process")
    assert again["warm_start"] == {**report["warm_start"], "reused": True}
    assert again["settings"]["config"]["backend"]["trainer_process"] is True


@pytest.mark.slow
@pytest.mark.long  # out of CI's 45 minutes (-m long runs it)
def test_quick_agent_run_reports_env_busy_for_every_kind(tmp_path):
    """--workload agent: every rollout an episode of LatencyEnv steps; all four kinds finish their steps."""
    json_path = tmp_path / "agent.json"
    done = run_script(SCRIPT, "--quick", "--workload", "agent", "--max-lag", "1", "--out", tmp_path, "--json",
                      json_path, timeout=300)
    report = json.loads(json_path.read_text())
    steps, batch = report["settings"]["steps"], report["settings"]["batch"]
    assert set(report["kinds"]) == {"sync", "april", "urb lag<=1", "stream lag<=1"}
    header = next(line for line in done.stdout.splitlines() if line.startswith("| kind |"))
    assert "| trainer busy | env busy | lag mean / max |" in header, header
    for name, row in report["kinds"].items():
        (run,) = row["runs"]
        assert len(run) == steps and all(len(s["lengths"]) == batch for s in run), name
        assert any(line.startswith(f"| `{row['kind']}`") for line in done.stdout.splitlines()), name
        # every trained episode went reset -> turn -> step -> turn -> step, and its steps overlapped others'
        assert row["episode_ends"].get("end/done", 0) >= steps * batch, (name, row["episode_ends"])
        assert row["env_pool"]["calls"] >= 3 * steps * batch, (name, row["env_pool"])
        assert row["env_busy"] > 1.0, (name, row["env_busy"])
        assert 0 < row["steps_per_second"] and row["reward_mean"] is not None, name
    # the multi-turn path keeps sync's and urb's order: each step trains exactly its data group
    for name in ("sync", "urb lag<=1"):
        for t, s in enumerate(report["kinds"][name]["runs"][0]):
            assert sorted(s["positions"]) == list(range(t * batch, (t + 1) * batch)), (name, t)
    assert report["kinds"]["urb lag<=1"]["lag_max"] <= 1 and report["kinds"]["sync"]["lag_max"] == 0
