"""The reference agent recipes resolve their environments and run a few steps on CPU with a small local model."""

import json

import pytest

from flashreinforce.config import load_config
from flashreinforce.run.training import run_training

pytestmark = pytest.mark.slow  # whole runs with sandboxed tool calls, ~10 s each


def _local(model_dir, data, tiny_run):
    """The GPU recipes' settings brought down to this machine: the embedded engine, one process and one trainer
    rank (the recipes shard over 4 or 8 GPUs), tiny budgets."""
    keep = [o for o in tiny_run if o.startswith(("log.", "verifier."))]
    return [*keep, f"model.path={model_dir}", "precision.trainer=fp32", "precision.rollout=fp32",
            f"data.train={data}", f"data.eval={data}",
            "rollout.engine=local", "backend.kind=local", "trainer.world_size=1", "trainer.sharding=replicate",
            "rollout.max_batch_size=8", "rollout.max_new_tokens=24",
            "scheduler.batch_groups=4", "trainer.steps=2", "trainer.checkpoint_every=1", "trainer.microbatch_size=4",
            "trainer.warmup_steps=0", "eval.num_prompts=4", "eval.k=1", "eval.every=0", "env.max_prompt_tokens=64",
            "env.max_workers=1"]


@pytest.fixture
def chat_model(save_chat_model, tmp_path):
    model_dir = save_chat_model(32, 1)
    rows = [{"prompt": [{"role": "user", "content": f"What is {a}*{b}? Use <code>print(...)</code>."}],
             "reward_model": {"ground_truth": str(a * b)}} for a in range(2, 6) for b in range(2, 6)]
    data = tmp_path / "tool.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return model_dir, data


@pytest.mark.parametrize("recipe", ["qwen7b_tool", "qwen3_tool_ablation"])
def test_a_tool_recipe_runs_multi_turn_on_a_small_local_model(recipe, chat_model, tiny_run, tmp_path):
    model_dir, data = chat_model
    config = load_config(recipe, _local(model_dir, data, tiny_run))
    assert config.env.kind == "python_tool" and config.env.max_turns > 1
    summary = run_training(config, run_dir=tmp_path / "run")
    assert summary["optimizer_steps"] == 2 and summary["trained_trajectories"] == 8
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"].endswith("<|im_start|>assistant\n") for s in samples)


def test_the_alfworld_recipe_says_what_is_missing(chat_model, tiny_run, tmp_path, monkeypatch):
    model_dir, data = chat_model
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    config = load_config("alfworld", _local(model_dir, data, tiny_run))
    with pytest.raises((RuntimeError, ImportError, ValueError), match="(?i)alfworld"):
        run_training(config, run_dir=tmp_path / "run")


@pytest.mark.parametrize("extra", [["scheduler.kind=sync"], ["scheduler.kind=urb"], ["scheduler.kind=april"],
                                   ["scheduler.kind=stream", "algo.wpsm={tau: 0.0, eta: 100.0}",
                                    "algo.options={negative_token_fraction: 0.5}"]],
                         ids=["sync", "urb", "april", "stream-wpsm-entropy-filter"])
def test_episodes_run_under_every_scheduler_and_with_wpsm_and_the_entropy_filter(agent_run, extra, tmp_path):
    config = load_config(agent_run[0], [*agent_run[1:], "trainer.steps=2", *extra])
    summary = run_training(config, run_dir=tmp_path / "run")  # checks the exactly-once ledger at the end
    assert summary["optimizer_steps"] == 2 and summary["trained_trajectories"] == 16
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "loss/policy" in m]
    ended = [sum(v for k, v in m.items() if k.startswith("episode/end/")) for m in trained]
    assert len(trained) == 2 and 0 < ended[0] <= ended[1]  # counters of ended episodes, over the whole run


def test_moe_episodes_record_and_replay_routes_across_turns(agent_run, tmp_path):
    """Multi-turn rows on an MoE model, unified bf16, sync (every token sampled by the weights it trains): the
    routes of every turn, re-read after each observation, are the trainer's own, and log-probs agree."""
    config = load_config(agent_run[0], [*agent_run[1:], "trainer.steps=2", "scheduler.kind=sync",
                                        "model.tiny.num_experts=4", "precision.trainer=bf16",
                                        "precision.rollout=bf16", "precision.mode=unified"])
    summary = run_training(config, run_dir=tmp_path / "run")
    assert summary["optimizer_steps"] == 2
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "loss/policy" in m]
    assert all(m["mismatch/route_disagreement"] == 0.0 for m in trained)
    assert all(m["mismatch/same_weights_tokens"] == m["batch/policy_tokens"] for m in trained)
    assert all(m["mismatch/same_weights_abs_max"] < 1e-4 for m in trained)
    assert summary["initial_turns"] > 1  # the rows are multi-turn: observations between turns


def test_the_smollm2_tool_recipe_warm_starts_and_runs_tool_episodes_as_chat(save_chat_model, tiny_run, tmp_path):
    """The recipe on a small chat model: SFT on chat traces, then episodes whose tool output is a `tool` message
    in the template's own rendering, and held-out tool calls reported before and after."""
    keep = [o for o in tiny_run if o.startswith(("log.", "verifier."))]
    config = load_config("smollm2_tool", [
        *keep, f"model.path={save_chat_model(32, 1)}", "precision.trainer=fp32", "precision.rollout=fp32",
        "data.tool_multiply.num_train=40", "data.tool_multiply.num_eval=4", "stages.0.steps=2", "sft.batch_size=4",
        "sft.tool_rate=1.0", "rollout.max_new_tokens=24", "scheduler.batch_groups=4", "stages.1.steps=2",
        "trainer.checkpoint_every=1", "trainer.microbatch_size=4", "eval.num_prompts=4", "env.max_workers=1"])
    assert config.data.tool_multiply.chat and config.env.role == "tool"
    summary = run_training(config, run_dir=tmp_path / "run")
    assert summary["optimizer_steps"] == 2 and summary["trained_trajectories"] == 8
    warm, rl = summary["stages"]
    assert warm["kind"] == "sft" and (tmp_path / "run" / "stages" / "01-warm" / "sft" / "model.safetensors").is_file()
    assert "initial_tool_calls" in rl and "final_tool_calls" in rl
    samples = [json.loads(line) for line in
               (tmp_path / "run" / "stages" / "02-rl" / "samples.jsonl").read_text().splitlines()]
    assert samples and all("<|im_start|>user\nWhat is " in s["prompt"] for s in samples)
