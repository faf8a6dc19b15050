"""Whole runs on the hubs' environments, against the real libraries: a verifiers environment (its agent calling the
policy through the endpoint, its rubric the reward) and an OpenEnv environment (in-process, and over its HTTP
server on loopback) each train a few steps on a tiny chat model. .ci/hubs runs them in the virtualenv that holds
both extras."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hub_envs import OPENENV_MODULE, VERIFIERS_PACKAGE, write_hub_envs

pytestmark = pytest.mark.slow
STEPS = 3


def _hub_env(tmp_path: Path) -> dict[str, str]:
    """The process environment of a command that imports the test's environments."""
    envs = write_hub_envs(tmp_path / "envs")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(envs), os.environ.get("PYTHONPATH", "")])}


def _train(tmp_path: Path, model: Path, overrides: list[str]) -> tuple[dict, list[dict], list[dict]]:
    """Run `flashreinforce train` with the test's environments importable; its summary, step rows and samples."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "flashreinforce", "train", "--output", str(run_dir), f"model.path={model}",
               "data.kind=env", "data.env.num_train=64", "data.env.num_eval=4", "env.reward=env",
               "env.max_workers=1", "rollout.max_new_tokens=8", "rollout.max_batch_size=16", "scheduler.group_size=4",
               "scheduler.batch_groups=4", f"trainer.steps={STEPS}", "trainer.microbatch_size=8", "eval.num_prompts=4",
               "eval.k=1", "log.progress=false", "log.tensorboard=false", "log.samples_per_step=16",
               "verifier.min_workers=1", "verifier.max_workers=1", *overrides]
    done = subprocess.run(command, check=False, env=_hub_env(tmp_path), cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return json.loads((run_dir / "summary.json").read_text()), [row for row in rows if "loss/policy" in row], samples


def _rewards_vary(samples: list[dict]) -> bool:
    """The parity rewards of a random model's replies differ between trained samples (the environment's reward,
    not a constant)."""
    return len({sample["reward"] for sample in samples}) > 1


@pytest.mark.verifiers
def test_a_verifiers_environment_trains_through_the_endpoint(save_chat_model, tmp_path):
    """Every eighth task's reward is not a number: those episodes end as agent_error, counted, and the run goes on."""
    options = (f"{{taskset: {{id: {VERIFIERS_PACKAGE}, size: 64, fault: some}}, "
               "agent: {runtime: {type: subprocess}}}")
    summary, steps, samples = _train(tmp_path, save_chat_model(32, 1), [
        "env.kind=verifiers", f"env.options={options}", "data.env.eval={split: test}", "env.max_prompt_tokens=96"])
    assert summary["optimizer_steps"] == STEPS and summary["trained_trajectories"] == STEPS * 16
    last = steps[-1]
    assert last["episode/end/done"] >= STEPS * 12 and last["episode/end/agent_error"] >= 1, last
    assert last["endpoint/calls"] >= 2 * last["episode/end/done"], "its agent's two calls each episode"
    assert last["episode/multi_segment"] == 0, "the second call continues the first, token for token"
    assert _rewards_vary(samples)
    same = [row["mismatch/same_weights_abs_max"] for row in steps if "mismatch/same_weights_abs_max" in row]
    assert same and max(same) <= 1e-5, "behavior log-probs are the trainer's own"
    # the run's checkpoint evaluates on the held-out tasks (the test split) with the environment's agent
    evaluation = subprocess.run([sys.executable, "-m", "flashreinforce", "eval", str(tmp_path / "run"), "--k", "1",
                                 "--json", str(tmp_path / "eval.json")], check=False, env=_hub_env(tmp_path),
                                capture_output=True, text=True, timeout=300)
    assert evaluation.returncode == 0, (evaluation.stdout + evaluation.stderr)[-4000:]
    assert json.loads((tmp_path / "eval.json").read_text())["num_prompts"] == 4


@pytest.mark.openenv
@pytest.mark.parametrize("where", ["env", "app"])
def test_an_openenv_environment_trains_in_process_and_over_its_server(where, save_chat_model, tmp_path):
    target = f"{OPENENV_MODULE}:ParityEnvironment" if where == "env" else f"{OPENENV_MODULE}:app"
    summary, steps, samples = _train(tmp_path, save_chat_model(32, 1), [
        "env.kind=openenv", f"env.options={{{where}: '{target}'}}", "env.max_turns=2", "env.max_prompt_tokens=64",
        "env.stop_strings=[' ']", "rollout.max_new_tokens=64", "data.env.instruction=Say something."])
    assert summary["optimizer_steps"] == STEPS and summary["trained_trajectories"] == STEPS * 16
    last = steps[-1]
    ended = {key: value for key, value in last.items() if key.startswith("episode/end/")}
    assert sum(ended.values()) >= STEPS * 16 and ended["episode/end/done"] > 0, ended  # done, or out of budget
    assert "episode/end/env_error" not in ended and "episode/end/env_timeout" not in ended, ended
    assert _rewards_vary(samples)
    assert samples[0]["prompt"].startswith("<|im_start|>"), "the instruction as a user message, in the chat template"
