"""A pipeline of stages (SFT, then RL on one task, then RL on two with a fresh optimizer and another lr), killed
at aimed moments, boundaries included, and resumed: bitwise equal to an uninterrupted run in --deterministic
mode, every rollout trained once or recorded dropped in the overlapped mode. Stages that share a task go on
through its prompts (disjoint prompts, once each until the epoch wraps, keys never reused); AHRL in a later stage
measures the SFT model and counts the stage's own steps."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import MIX_RUN
from flashreinforce.run.evaluation import resolve_model_dir
from flashreinforce.trainer.checkpoint import latest_checkpoint
from run_ledger import final_ledger, kill_at_replace, kill_when

pytestmark = pytest.mark.slow  # a whole pipeline is ~11 s on 2 cores; each test runs two to three

BATCH = 8
STAGES = ("stages=[{name: warm, kind: sft, steps: 10}, {name: sums, steps: 4, tasks: {sums: {}}},"
          " {name: both, steps: 4, optimizer: reset, trainer: {lr: 5.0e-5}}]")
RL_STAGES = {"02-sums": (0, 4), "03-both": (4, 8)}
"""Each RL stage's directory and its (first, last) optimizer step: steps count across stages."""


def _command(run_dir: Path, mix_run: list[str], *extra: str, stages: str = STAGES) -> list[str]:
    return [sys.executable, "-m", "flashreinforce", "train", "--output", str(run_dir), *mix_run, stages,
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


def _scheduled(run_dir: Path, stages: list[str]) -> list:
    """Every key the stages scheduled, in stage order: trained, dropped, or in flight at the final checkpoint (the
    stage's end drops those)."""
    keys = []
    for directory in stages:
        ledger = final_ledger(run_dir / "stages" / directory)
        keys += [*ledger.trained(), *ledger.dropped(), *ledger.outstanding()]
    return keys


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
    # Both RL stages train sums: the second goes on through its prompts where the first stopped (its in-flight
    # work dropped at stage_end included), none of them twice
    sums = [{key.prompt_id for key in _scheduled(run_dir, [directory]) if key.prompt_id.startswith("sums/")}
            for directory in RL_STAGES]
    assert sums[0] and sums[1] and not sums[0] & sums[1]
    assert by_name["sums"]["data_positions"] == {"sums": len(sums[0])}
    assert by_name["both"]["data_positions"]["sums"] == len(sums[0]) + len(sums[1])


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


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted --deterministic pipeline every killed one is compared with."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    subprocess.run(_command(run_dir, list(MIX_RUN), "--deterministic"), check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE, timeout=300)
    return run_dir


def _assert_same_as(killed: Path, straight: Path) -> None:
    _resume(killed)
    _assert_once(killed)
    assert _rows(killed) == _rows(straight)
    a, b = _final_weights(straight), _final_weights(killed)
    assert a.keys() == b.keys() and all((a[name] == b[name]).all() for name in a)


@pytest.mark.parametrize("marker", [
    "stages/01-warm/summary.json",              # at the SFT -> RL boundary
    "stages/02-sums/checkpoints/step_000002",   # mid-stage
    "stages/02-sums/summary.json",              # at the RL -> RL boundary
    "stages/03-both/checkpoints/step_000005",   # just after it
])
def test_deterministic_pipeline_killed_anywhere_resumes_bitwise(marker, straight, tmp_path):
    killed = tmp_path / "killed"
    kill_when(_command(killed, list(MIX_RUN), "--deterministic"), killed / marker, delay=0.0)
    assert not (killed / "summary.json").exists()
    _assert_same_as(killed, straight)


AIMED = {  # (file replaced into place, before or after the replace, which replace onto it)
    "sft_saved": ("stages/01-warm/sft", "after", 1),              # the SFT stage's model saved, its summary not
    "stage_summary": ("stages/02-sums/summary.json", "before", 1),  # an RL stage done but for its summary
    "pipeline_metrics": ("metrics.jsonl", "before", 2),           # the pipeline's metrics after the sums stage
    "pipeline_summary": ("summary.json", "before", 1),            # the pipeline's own summary, at the very end
}


@pytest.mark.parametrize("moment", list(AIMED))
def test_deterministic_pipeline_killed_inside_its_writes_resumes_bitwise(moment, straight, tmp_path):
    """A kill inside a stage's or the pipeline's own writes: whatever a stage writes, its redo replaces (an SFT
    stage redone after its model was saved saves again over it)."""
    target, when, nth = AIMED[moment]
    killed = tmp_path / "killed"
    kill_at_replace(_command(killed, list(MIX_RUN), "--deterministic")[3:], killed / target, when=when, nth=nth)
    assert not (killed / "summary.json").exists()
    _assert_same_as(killed, straight)


def test_a_task_trained_again_goes_on_through_its_prompts_once_each_and_its_keys_are_never_reused(tmp_path):
    """sums has 20 training prompts and both RL stages train it (32 + 32 positions at least): its epochs wrap
    inside and across the stages, yet no prompt is trained a second time before every one was trained once, and
    no (prompt, sample) key, whose request seed is drawn from it, is used twice in the pipeline."""
    run_dir = tmp_path / "run"
    subprocess.run(_command(run_dir, list(MIX_RUN), "--deterministic", "tasks.sums.data.arithmetic.num_train=20"),
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
    keys = [key for key in _scheduled(run_dir, list(RL_STAGES)) if key.prompt_id.startswith("sums/")]
    assert len(keys) == len(set(keys)), "a key was used twice"
    prompts = sorted({key.prompt_id for key in keys})
    assert len(prompts) == 20
    for prompt in prompts:  # the k-th time a prompt is scheduled is its k-th sample, in every stage
        assert sorted(key.sample for key in keys if key.prompt_id == prompt) == list(
            range(sum(key.prompt_id == prompt for key in keys)))
    counts = [sum(key.prompt_id == prompt for key in keys) for prompt in prompts]
    assert max(counts) - min(counts) <= 1, f"some prompts were trained again before others once: {counts}"


HINTED = ("{name: hint, steps: 3, tasks: {sums: {}}, algo: {hints: {p_initial: 0.5, gamma: 0.5, k: 2, samples: 2, "
          "pass_threshold: 1.0, pass_floor: 0.5}}}")


def _stage_rows(run_dir: Path, stage: str, key: str) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "stages" / stage / "metrics.jsonl").read_text().splitlines()]
    return [row[key] for row in rows if key in row]


def test_ahrl_in_a_later_stage_measures_the_sft_model_and_counts_its_own_steps(tmp_path):
    """A hinted stage of sums after an RL stage of the game: pass_initial as a hinted stage right after SFT measures
    it (the SFT model's, not the RL stage's weights), and the same hints at each of its steps (eq. 5's t counts the
    stage's own steps: with pass_floor every hinted prompt's hint shrinks with t)."""
    runs = {}
    for name, stages in (("after_sft", f"[{{name: warm, kind: sft, steps: 10}}, {HINTED}]"),
                         ("after_rl", "[{name: warm, kind: sft, steps: 10}, {name: game, steps: 3, tasks: {game: {}},"
                                      f" trainer: {{lr: 1.0e-2}}}}, {HINTED}]")):
        runs[name] = tmp_path / name
        command = _command(runs[name], list(MIX_RUN), "--deterministic", stages=f"stages={stages}")
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
    after_sft = json.loads((runs["after_sft"] / "stages" / "02-hint" / "pass_initial.json").read_text())
    after_rl = json.loads((runs["after_rl"] / "stages" / "03-hint" / "pass_initial.json").read_text())
    assert after_sft == after_rl and len(after_sft) == 300
    hints = [_stage_rows(runs["after_sft"], "02-hint", "hints/mean_tokens"),
             _stage_rows(runs["after_rl"], "03-hint", "hints/mean_tokens")]
    assert len(hints[0]) == 3 and hints[0] == hints[1]
    assert hints[0][0] > hints[0][-1], "hints shrink over the stage's steps"


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
