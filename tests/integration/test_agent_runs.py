"""Whole runs of env.kind=agent: an agent written only against the `openai` client trains through the endpoint, and
a run SIGKILLed with agent episodes in flight (calls recorded, one caught in the engine) resumes: with
--deterministic to the same weights as an uninterrupted run, overlapped with every rollout trained exactly once."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flashreinforce.trainer.checkpoint import latest_checkpoint, load_states
from run_ledger import final_ledger, kill_when

pytestmark = [pytest.mark.slow, pytest.mark.endpoint]

STEPS = 5
BATCH = 8

AGENT = '''
async def run(client, row):
    """1 to 3 calls (by the row), each continuing the conversation; the reward reads the last reply."""
    messages = list(row["prompt"])
    text = ""
    for _ in range(1 + int(row["ground_truth"]) % 3):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "Are you sure?"}]
        text = reply.choices[0].message.content or ""
    return float(len(text) % 2)
'''


@pytest.fixture
def agent_run(save_chat_model, tmp_path) -> list[str]:
    """Overrides of a run whose agent calls a tiny random chat model (a Qwen-style template) 1 to 3 times."""
    model = save_chat_model(32, 1)
    for split, count in (("train", 96), ("eval", 4)):
        rows = [{"prompt": [{"role": "user", "content": f"What is {i}+3?"}],
                 "reward_model": {"ground_truth": str(i + 3)}} for i in range(count)]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "agent.py").write_text(AGENT)
    return [f"model.path={model}", "data.kind=files", f"data.train={tmp_path / 'train.jsonl'}",
            f"data.eval={tmp_path / 'eval.jsonl'}", "env.kind=agent", f"env.agent={tmp_path / 'agent.py'}:run",
            "env.reward=env", "env.max_prompt_tokens=96", "env.max_workers=1", "rollout.max_new_tokens=16",
            "rollout.max_batch_size=24", "scheduler.max_staleness=2", f"scheduler.batch_groups={BATCH}",
            f"trainer.steps={STEPS}", "trainer.microbatch_size=8", "trainer.checkpoint_every=1",
            f"trainer.keep_checkpoints={STEPS}", "eval.num_prompts=4", "eval.k=1", "log.progress=false",
            "log.tensorboard=false", "verifier.min_workers=1", "verifier.max_workers=1"]


def _command(run_dir: Path, overrides: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "flashreinforce", "train", "--output", str(run_dir), *overrides, *extra]


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)


def _agents_in_flight(checkpoint: Path) -> list:
    """The agent episodes a checkpoint holds in flight that had made a call."""
    _, controller_state, _ = load_states(checkpoint)
    return [partial.episode for _, partial in controller_state["inflight"] if partial.episode.calls]


def _resume_mid_episode(run_dir: Path) -> list:
    """Resume from the newest checkpoint holding agent episodes mid-way, as if the kill came right after it (newer
    checkpoints are removed); returns those episodes."""
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"), reverse=True)
    intact = [c for c in checkpoints if c.name[5:].isdigit() and (c / "meta.json").exists()]
    chosen = next((c for c in intact if _agents_in_flight(c)), None)
    assert chosen is not None, f"no checkpoint of {[c.name for c in intact]} holds an agent episode mid-way"
    for newer in checkpoints:
        if newer.name > chosen.name:
            shutil.rmtree(newer)
    return _agents_in_flight(chosen)


def _assert_complete(run_dir: Path) -> None:
    ledger = final_ledger(run_dir)
    assert sorted(ledger.trained().values()) == sorted(s for s in range(STEPS) for _ in range(BATCH)), ledger.summary()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["optimizer_steps"] == STEPS and summary["trained_trajectories"] == STEPS * BATCH


def test_an_openai_client_agent_trains_through_the_endpoint(agent_run, tmp_path):
    run_dir = tmp_path / "run"
    _run(_command(run_dir, agent_run))
    _assert_complete(run_dir)
    endpoint = json.loads((run_dir / "endpoint.json").read_text())
    assert endpoint["base_url"].startswith("http://127.0.0.1:") and endpoint["api_key"]
    assert (run_dir / "endpoint.json").stat().st_mode & 0o077 == 0, "the key is its owner's only"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss/policy" in row]
    assert steps[-1]["episode/end/done"] > 0 and steps[-1]["endpoint/calls"] > steps[-1]["episode/end/done"]
    # behavior log-probs are the trainer's own (tokens trained under the weights that sampled them)
    same = [row["mismatch/same_weights_abs_max"] for row in steps if "mismatch/same_weights_abs_max" in row]
    assert same and max(same) <= 1e-5
    # a checkpoint of the run evaluates with its agent too (an engine and an endpoint of its own)
    result = subprocess.run([sys.executable, "-m", "flashreinforce", "eval", str(run_dir), "--k", "1", "--json",
                             str(tmp_path / "eval.json")], check=True, capture_output=True, text=True, timeout=300)
    assert json.loads((tmp_path / "eval.json").read_text())["num_prompts"] == 4, result.stdout


def test_deterministic_kill_with_agents_in_flight_resumes_to_identical_weights(agent_run, tmp_path):
    _run(_command(tmp_path / "straight", agent_run, "--deterministic"))
    killed = tmp_path / "killed"
    delay = random.Random(os.getpid()).uniform(0, 0.2)
    kill_when(_command(killed, agent_run, "--deterministic"), killed / "checkpoints" / "step_000002", delay)
    episodes = _resume_mid_episode(killed)
    assert any(c.generation.finish_reason == "abort" for e in episodes for c in e.calls), "no call caught in flight"
    _run([sys.executable, "-m", "flashreinforce", "train", "--resume", str(killed)])
    _assert_complete(killed)
    straight = load_file(latest_checkpoint(tmp_path / "straight" / "checkpoints") / "model" / "model.safetensors")
    resumed = load_file(latest_checkpoint(killed / "checkpoints") / "model" / "model.safetensors")
    for name in straight:
        assert (straight[name] == resumed[name]).all(), f"{name} differs after kill and resume"
    rows = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert any(row.get("endpoint/replayed", 0) > 0 for row in rows), "the resumed agents were not replayed"


def test_overlapped_kill_with_agents_in_flight_trains_every_rollout_once(agent_run, tmp_path):
    run_dir = tmp_path / "run"
    kill_when(_command(run_dir, agent_run), run_dir / "checkpoints" / "step_000003", 0.05)
    _resume_mid_episode(run_dir)
    _run([sys.executable, "-m", "flashreinforce", "train", "--resume", str(run_dir)])
    _assert_complete(run_dir)
