"""A training subprocess killed with SIGKILL mid-run resumes with nothing lost or duplicated."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flashreinforce.trainer.checkpoint import latest_checkpoint, list_checkpoints, load_states
from run_ledger import final_ledger, kill_when

pytestmark = pytest.mark.slow  # 2-3 whole `flashreinforce train` subprocesses a test, ~10-19 s each on 2 cores
# (most of a run is the interpreter importing torch and transformers, ~4 s, which no smaller config removes)

STEPS = 10
BATCH = 8


def _command(run_dir: Path, tiny_run: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "flashreinforce", "train", "--output", str(run_dir), *tiny_run,
            f"trainer.steps={STEPS}", f"scheduler.batch_groups={BATCH}", "log.tensorboard=false", *extra]


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)


def _kill_midway(command: list[str], run_dir: Path, after_step: int, delay: float) -> int:
    """Start a run, SIGKILL it `delay` seconds after checkpoint `after_step` appears; returns its pid."""
    return kill_when(command, run_dir / "checkpoints" / f"step_{after_step:06d}", delay)


def _trainer_children(parent_pid: int) -> list[int]:
    """Live trainer processes started by `parent_pid` (their command line names it)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"flashreinforce.trainer.process" in argv and argv[-2:-1] == [str(parent_pid).encode()] and state != "Z":
            found.append(int(entry.name))
    return found


def _weights(run_dir: Path) -> dict:
    return load_file(latest_checkpoint(run_dir / "checkpoints") / "model" / "model.safetensors")


def _assert_complete(run_dir: Path) -> None:
    ledger = final_ledger(run_dir)
    trained = ledger.trained()
    assert len(trained) == STEPS * BATCH, ledger.summary()
    per_step = sorted(trained.values())
    assert per_step == sorted(s for s in range(STEPS) for _ in range(BATCH))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["optimizer_steps"] == STEPS and summary["trained_trajectories"] == STEPS * BATCH
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "loss/policy" in line]
    assert steps == list(range(1, STEPS + 1)), "metrics.jsonl must read like an uninterrupted run's"


def _episodes_in_flight(checkpoint: Path) -> list:
    """The multi-turn episodes a checkpoint holds in flight that had taken at least one environment step."""
    _, controller_state, _ = load_states(checkpoint)
    return [partial.episode for _, partial in controller_state["inflight"]
            if partial.episode is not None and partial.episode.turns > 0]


def _resume_mid_episode(run_dir: Path) -> Path:
    """Make the resume start from the newest checkpoint that holds episodes mid-way (their environments are
    rebuilt by replay), as if the kill had come right after it: newer checkpoints are removed. Returns it."""
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"), reverse=True)
    intact = [c for c in checkpoints if c.name[5:].isdigit() and (c / "meta.json").exists()]
    chosen = next((c for c in intact if _episodes_in_flight(c)), None)
    assert chosen is not None, f"no checkpoint of {[c.name for c in intact]} holds an episode mid-way"
    for newer in checkpoints:
        if newer.name > chosen.name:
            shutil.rmtree(newer)
    return chosen


@pytest.fixture
def minibatch_run(tiny_run) -> list[str]:
    """Each batch trained as 2 optimizer steps, with WPSM's per-query success rates (both carried through the
    checkpoint: the theta_old pass is redone from the saved weights, the rates are saved)."""
    return [*tiny_run, "trainer.minibatches=2", "algo.wpsm={tau: 0.2, eta: 10.0, min_rollouts: 1}"]


@pytest.mark.parametrize("run", ["tiny_run", "agent_run", "moe_run", "mix_run", "vision_run", "vision_agent_run",
                                 "minibatch_run"])
def test_deterministic_kill_and_resume_ends_with_identical_weights(run, request, tmp_path):
    tiny_run = request.getfixturevalue(run)
    _run(_command(tmp_path / "straight", tiny_run, "--deterministic"))
    killed = tmp_path / "killed"
    rng = random.Random(os.getpid())
    _kill_midway(_command(killed, tiny_run, "--deterministic"), killed, after_step=2, delay=rng.uniform(0, 0.2))
    if run in ("agent_run", "vision_agent_run"):
        chosen = _resume_mid_episode(killed)
    if run == "vision_agent_run":  # the episodes in flight keep every picture their rows show (the prompt has none)
        _, controller_state, _ = load_states(chosen)
        assert all(len(p.images) == 1 + len(p.episode.actions) for _, p in controller_state["inflight"])

    assert not (killed / "summary.json").exists()
    _run([sys.executable, "-m", "flashreinforce", "train", "--resume", str(killed)])
    _assert_complete(killed)
    straight, resumed = _weights(tmp_path / "straight"), _weights(killed)
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert (straight[name] == resumed[name]).all(), f"{name} differs after kill and resume"


@pytest.mark.parametrize(("run", "delay"), [("tiny_run", 0.0), ("tiny_run", 0.2), ("agent_run", 0.1),
                                            ("moe_run", 0.1), ("mix_run", 0.1)])
def test_overlapped_kill_and_resume_trains_every_rollout_once(run, request, tmp_path, delay):
    run_dir = tmp_path / "run"
    if run == "agent_run":  # whether a step's checkpoint holds an episode mid-way depends on timing (about 1 in 3
        # of them holds none, measured): keep every checkpoint of six steps to choose one from
        command = _command(run_dir, request.getfixturevalue(run), f"trainer.keep_checkpoints={STEPS}")
        _kill_midway(command, run_dir, after_step=6, delay=delay)
        _resume_mid_episode(run_dir)
    else:
        _kill_midway(_command(run_dir, request.getfixturevalue(run)), run_dir, after_step=3, delay=delay)
    if run == "moe_run":  # partial rollouts in a checkpoint keep their MoE routes (R3) into the resume; whether
        # the kill left any depends on timing (under load none may be in flight), so the deterministic round trip
        # through a checkpoint is tests/unit/rollout/test_engine_routes.py's
        for checkpoint in list_checkpoints(run_dir / "checkpoints"):  # not a staging dir the kill cut short
            _, controller_state, _ = load_states(checkpoint)
            assert all(p.routes is not None and p.routes.layers == 1 for _, p in controller_state["inflight"])
    _run([sys.executable, "-m", "flashreinforce", "train", "--resume", str(run_dir)])
    _assert_complete(run_dir)


def test_a_trainer_process_dies_with_a_killed_run_which_then_resumes(tiny_run, tmp_path):
    run_dir = tmp_path / "run"
    pid = _kill_midway(_command(run_dir, tiny_run, "backend.trainer_process=true"), run_dir, after_step=3, delay=0.1)
    deadline = time.monotonic() + 10
    while _trainer_children(pid):  # SIGKILLed by the kernel with its parent (lifetime.die_with_parent)
        assert time.monotonic() < deadline, "the trainer process outlived its killed run"
        time.sleep(0.05)
    _run([sys.executable, "-m", "flashreinforce", "train", "--resume", str(run_dir), "backend.trainer_process=true"])
    _assert_complete(run_dir)


@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
def test_a_killed_data_parallel_rank_fails_the_run_loudly_and_the_run_resumes(tiny_run, tmp_path, sharding):
    """fsdp: the checkpoints (the model gathered to rank 0, the optimizer state in full) resume a sharded group."""
    run_dir = tmp_path / "run"
    command = _command(run_dir, tiny_run, "trainer.world_size=2", f"trainer.sharding={sharding}")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "step_000003").exists():
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.02)
        ranks = _trainer_children(process.pid)
        assert len(ranks) == 2, ranks
        os.kill(max(ranks), signal.SIGKILL)  # the rank started second, usually rank 1
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode != 0, "the run went on without one of its ranks"
    assert "failed during 'step'" in stderr and "flashreinforce train --resume" in stderr, stderr[-3000:]
    _run([sys.executable, "-m", "flashreinforce", "train", "--resume", str(run_dir)])
    _assert_complete(run_dir)
