"""A pipeline of stages (SFT, then RL on one task, then RL on two with a fresh optimizer and another lr), killed
at aimed moments, boundaries included, and resumed: bitwise equal to an uninterrupted run in --deterministic
mode, every rollout trained once or recorded dropped in the overlapped mode."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flashreinforce.run.evaluation import resolve_model_dir
from flashreinforce.trainer.checkpoint import latest_checkpoint
from run_ledger import final_ledger, kill_when

pytestmark = pytest.mark.slow  # a whole pipeline is ~11 s on 2 cores; each test runs two to three

BATCH = 8
STAGES = ("stages=[{name: warm, kind: sft, steps: 10}, {name: sums, steps: 4, tasks: {sums: {}}},"
          " {name: both, steps: 4, optimizer: reset, trainer: {lr: 5.0e-5}}]")
RL_STAGES = {"02-sums": (0, 4), "03-both": (4, 8)}
"""Each RL stage's directory and its (first, last) optimizer step: steps count across stages."""


def _command(run_dir: Path, mix_run: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "flashreinforce", "train", "--output", str(run_dir), *mix_run, STAGES,
            f"scheduler.batch_groups={BATCH}", "trainer.checkpoint_every=1", *extra]


def _resume(run_dir: Path) -> None:
    subprocess.run([sys.executable, "-m", "flashreinforce", "train", "--resume", str(run_dir)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)


def _final_weights(run_dir: Path) -> dict:
    return load_file(latest_checkpoint(run_dir / "stages" / "03-both" / "checkpoints") / "model" / "model.safetensors")


def _rows(run_dir: Path) -> list[tuple]:
    """The pipeline's metrics.jsonl without its clock readings: (step, stage, losses, rewards, eval scores)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["stage"], *sorted((k, v) for k, v in row.items()
                                                 if k.startswith(("loss/", "reward/", "eval/", "optim/"))))
            for row in rows]


def _assert_once(run_dir: Path) -> None:
    """Every RL stage trained BATCH rollouts at each of its steps, each once; what its end left in flight is
    recorded dropped (stage_end); the pipeline's files name every stage."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [stage["stage"] for stage in summary["stages"]] == ["warm", "sums", "both"]
    by_name = {stage["stage"]: stage for stage in summary["stages"]}
    for directory, (first, last) in RL_STAGES.items():
        ledger = final_ledger(run_dir / "stages" / directory)
        trained = ledger.trained()
        assert sorted(trained.values()) == sorted(step for step in range(first, last) for _ in range(BATCH))
        stage = by_name[directory.split("-", 1)[1]]
        assert stage["first_step"] == first and stage["optimizer_steps"] == last
        assert stage["trained_trajectories"] == (last - first) * BATCH
        assert stage["dropped_trajectories"].get("stage_end", 0) == ledger.summary()["outstanding"]
    assert summary["optimizer_steps"] == 8 and summary["trained_trajectories"] == 8 * BATCH
    steps = [row[0] for row in _rows(run_dir) if any(k == "loss/policy" for k, _ in row[2:])]
    assert steps == list(range(1, 9)), "the pipeline's metrics.jsonl must read like an uninterrupted run's"


def test_stages_run_in_order_on_the_same_weights(mix_run, tmp_path):
    run_dir = tmp_path / "run"
    subprocess.run(_command(run_dir, mix_run, "--deterministic"), check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE, timeout=300)
    _assert_once(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    both = [row for row in rows if row["stage"] == "both" and "optim/lr" in row]
    assert both and all(row["optim/lr"] == pytest.approx(5e-5) for row in both), "stage 3's own lr"
    stage_two = (run_dir / "stages" / "02-sums" / "metrics.jsonl").read_text()
    assert "task/game/" not in stage_two and "task/game/" in (run_dir / "stages" / "03-both" / "metrics.jsonl").read_text()
    # Stage 2 starts from the SFT stage's weights, stage 3 from stage 2's last checkpoint.
    sft = load_file(run_dir / "stages" / "01-warm" / "sft" / "model.safetensors")
    initial = load_file(run_dir / "initial" / "model.safetensors")
    assert any(not (sft[name] == initial[name]).all() for name in sft), "the sft stage trained"
    assert (run_dir / "plots" / "reward.png").is_file()
    # `flashreinforce eval` takes the pipeline (its last stage's final checkpoint) or any stage's directory.
    assert resolve_model_dir(run_dir)[0] == latest_checkpoint(run_dir / "stages" / "03-both" / "checkpoints") / "model"
    assert resolve_model_dir(run_dir / "stages" / "01-warm") == (run_dir / "stages" / "01-warm" / "sft",
                                                                 run_dir / "stages" / "01-warm")


@pytest.mark.parametrize("marker", [
    "stages/01-warm/summary.json",              # at the SFT -> RL boundary
    "stages/02-sums/checkpoints/step_000002",   # mid-stage
    "stages/02-sums/summary.json",              # at the RL -> RL boundary
    "stages/03-both/checkpoints/step_000005",   # just after it
])
def test_deterministic_pipeline_killed_anywhere_resumes_bitwise(marker, mix_run, tmp_path):
    straight = tmp_path / "straight"
    subprocess.run(_command(straight, mix_run, "--deterministic"), check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE, timeout=300)
    killed = tmp_path / "killed"
    kill_when(_command(killed, mix_run, "--deterministic"), killed / marker, delay=0.0)
    assert not (killed / "summary.json").exists()
    _resume(killed)
    _assert_once(killed)
    assert _rows(killed) == _rows(straight)
    a, b = _final_weights(straight), _final_weights(killed)
    assert a.keys() == b.keys() and all((a[name] == b[name]).all() for name in a)


@pytest.mark.parametrize("marker", ["stages/02-sums/checkpoints/step_000002", "stages/02-sums/summary.json"])
def test_overlapped_pipeline_killed_and_resumed_trains_every_rollout_once(marker, mix_run, tmp_path):
    run_dir = tmp_path / "run"
    kill_when(_command(run_dir, mix_run), run_dir / marker, delay=0.05)
    _resume(run_dir)
    _assert_once(run_dir)


@pytest.mark.ray
def test_a_pipeline_runs_on_ray_each_stage_with_its_own_actors(mix_run, tmp_path):
    pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")
    run_dir = tmp_path / "run"
    subprocess.run(_command(run_dir, mix_run, "backend.kind=ray"), check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE, timeout=600)
    _assert_once(run_dir)
