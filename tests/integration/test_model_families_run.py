"""Each family the local engine serves trains through the ordinary run path: a tiny model of the family saved as a
Hugging Face folder, named by model.path, loaded with its default attention (eager for Gemma 2 and GPT-OSS),
served by the engine and trained, its behavior log-probs equal to the trainer's recompute (fp32)."""

import json

import pytest
from model_families import FAMILY_NAMES, REPLAYED_FAMILIES, tiny_family_model

from flashreinforce.config import load_config
from flashreinforce.run import run_training


@pytest.fixture
def chat_rows(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "reward_model": {"ground_truth": str(a + b)}}
            for a in range(4) for b in range(4)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def family_run(name, chat_tokenizer, chat_rows, tiny_run, tmp_path, *overrides):
    model_dir = tmp_path / name
    tiny_family_model(name, vocab_size=len(chat_tokenizer), pad_token_id=chat_tokenizer.pad_token_id,
                      eos_token_id=chat_tokenizer.eos_token_id).save_pretrained(model_dir)
    chat_tokenizer.save_pretrained(model_dir)
    config = load_config(None, [*tiny_run, f"model.path={model_dir}", "data.kind=files", f"data.train={chat_rows}",
                                f"data.eval={chat_rows}", "scheduler.batch_groups=4", "trainer.steps=2",
                                "rollout.max_new_tokens=12", "eval.num_prompts=4", "eval.every=0",
                                "log.tensorboard=false", *overrides])
    return run_training(config, run_dir=tmp_path / "run")


@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name in ("gemma2", "mixtral") else pytest.mark.slow)
                                  for name in FAMILY_NAMES])
def test_a_family_trains_through_the_run_path_with_exact_behavior_logprobs(
        name, chat_tokenizer, chat_rows, tiny_run, tmp_path):
    summary = family_run(name, chat_tokenizer, chat_rows, tiny_run, tmp_path,
                         f"trainer.router_replay={'false' if name == 'dbrx' else 'true'}")
    assert summary["optimizer_steps"] == 2 and summary["trained_trajectories"] == 8
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "mismatch/same_weights_tokens" in row]
    compared = [row["mismatch/same_weights_abs_max"] for row in trained if row["mismatch/same_weights_tokens"]]
    assert len(trained) == 2 and compared and max(compared) <= 1e-5
    if name in REPLAYED_FAMILIES:
        assert all(row["mismatch/route_disagreement"] == 0.0 for row in trained)


def test_router_replay_on_a_family_whose_routes_no_hook_reaches_is_refused_naming_the_setting(
        chat_tokenizer, chat_rows, tiny_run, tmp_path):
    with pytest.raises(ValueError, match=r"DbrxForCausalLM cannot have its routes .* trainer.router_replay=false"):
        family_run("dbrx", chat_tokenizer, chat_rows, tiny_run, tmp_path, "trainer.router_replay=true")
