"""A pipeline that trains side by side from one start and distills into one student: SFT, an RL stage of sums, an
SFT stage `from` the warm start, then a `distill` stage `from` the warm start whose tasks are each scored by their
own teacher stage (MOPD). Killed at the distill stage's boundary, inside it (after its teachers were measured, after
its first checkpoint) and inside its summary's write, it resumes bitwise equal to the uninterrupted run under
--deterministic, every rollout of every stage trained once."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import MIX_RUN
from flashreinforce.trainer.checkpoint import latest_checkpoint
from run_ledger import final_ledger, kill_at_replace, kill_when

pytestmark = pytest.mark.slow  # a pipeline is ~35 s on 2 cores; each kill test runs one and its resume

BATCH = 8
STAGES = ("stages=[{name: warm, kind: sft, steps: 10}, {name: sums, steps: 3, tasks: {sums: {}}},"
          " {name: tuned, kind: sft, from: warm, steps: 10},"
          " {name: merge, kind: distill, from: warm, steps: 4, teachers: {sums: {stage: tuned}, game: {stage: sums}}}]")
TRAINED = {"02-sums": (0, 3), "04-merge": (3, 7)}
"""Each stage that trains by RL: its directory and (first, last) optimizer step."""


def _command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "flashreinforce", "train", "--output", str(run_dir), *MIX_RUN, STAGES,
            f"scheduler.batch_groups={BATCH}", "trainer.checkpoint_every=1", "--deterministic"]


def _rows(run_dir: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["stage"], *sorted((k, v) for k, v in row.items()
                                                 if k.startswith(("loss/", "reward/", "eval/", "optim/", "task/"))))
            for row in rows]


def _final_weights(run_dir: Path) -> dict:
    return load_file(latest_checkpoint(run_dir / "stages" / "04-merge" / "checkpoints") / "model" / "model.safetensors")


def _assert_pipeline(run_dir: Path) -> None:
    """Every training stage trained BATCH rollouts a step, each once; the distill stage trained on opd with each
    task's teacher stage, reported the reverse KL per task and the teachers' held-out beside the student's."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(s["stage"], s["kind"]) for s in summary["stages"]] == [
        ("warm", "sft"), ("sums", "rl"), ("tuned", "sft"), ("merge", "distill")]
    for directory, (first, last) in TRAINED.items():
        trained = final_ledger(run_dir / "stages" / directory).trained()
        assert sorted(trained.values()) == sorted(step for step in range(first, last) for _ in range(BATCH))
    merge = summary["stages"][-1]
    stages = run_dir / "stages"
    assert {task: teacher["model"] for task, teacher in merge["teachers"].items()} == {
        "sums": str(stages / "03-tuned" / "sft"),
        "game": str(latest_checkpoint(stages / "02-sums" / "checkpoints") / "model")}
    assert set(merge["tasks"]) == {"sums", "game"} and all("teacher_accuracy" in t for t in merge["tasks"].values())
    rows = [json.loads(line) for line in (stages / "04-merge" / "metrics.jsonl").read_text().splitlines()]
    first = next(row for row in rows if "loss/reverse_kl" in row)
    assert first["step"] == 4 and first["task/sums/reverse_kl"] != 0.0, "the warm start differs from tuned"


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    subprocess.run(_command(run_dir), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
    _assert_pipeline(run_dir)
    return run_dir


def _assert_same_as(killed: Path, straight: Path) -> None:
    assert not (killed / "summary.json").exists()
    subprocess.run([sys.executable, "-m", "flashreinforce", "train", "--resume", str(killed)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
    _assert_pipeline(killed)
    assert _rows(killed) == _rows(straight)
    a, b = _final_weights(straight), _final_weights(killed)
    assert a.keys() == b.keys() and all((a[name] == b[name]).all() for name in a)


@pytest.mark.parametrize("marker", [
    "stages/03-tuned/summary.json",              # at the boundary into the distill stage
    "stages/04-merge/teacher_eval.json",         # its teachers measured, before its first step
    "stages/04-merge/checkpoints/step_000005",   # after its boundary, mid-stage
])
def test_a_distill_pipeline_killed_at_and_after_its_boundary_resumes_bitwise(marker, straight, tmp_path):
    killed = tmp_path / "killed"
    kill_when(_command(killed), killed / marker, delay=0.0)
    _assert_same_as(killed, straight)


def test_a_distill_pipeline_killed_before_its_summary_is_written_resumes_bitwise(straight, tmp_path):
    killed = tmp_path / "killed"
    kill_at_replace(_command(killed)[3:], killed / "stages" / "04-merge" / "summary.json", when="before")
    _assert_same_as(killed, straight)
