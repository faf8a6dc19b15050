"""The whole loop on a tiny model: SFT -> eval -> RL with each scheduler -> eval -> run directory."""

import json

import pytest

from flashreinforce.cli import main
from flashreinforce.run import run_training
from flashreinforce.config import load_config
from flashreinforce.trainer.checkpoint import latest_checkpoint, load_states


def test_default_loop_writes_a_complete_run_directory(tiny_run, tmp_path):
    config = load_config(None, tiny_run)
    summary = run_training(config, run_dir=tmp_path / "run")
    run = tmp_path / "run"
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "summary.json", "initial_eval.json"):
        assert (run / name).is_file(), name
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert {p.name for p in (run / "plots").glob("*.png")} >= {
        "reward.png", "heldout_accuracy.png", "entropy.png", "acceptance_rate.png", "lag_histogram.png",
        "tokens_per_second.png", "mismatch.png", "sequence_kl.png"}
    assert summary == json.loads((run / "summary.json").read_text())
    assert summary["optimizer_steps"] == 3
    assert summary["trained_trajectories"] == 3 * 8
    assert set(summary) >= {"initial_accuracy", "final_accuracy", "wall_seconds", "dropped_trajectories"}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss/policy" in r]
    assert steps == [1, 2, 3]
    # the embedded engine and the trainer share model code: train/inference mismatch ~ 0 in fp32
    assert all(r["mismatch/abs_logprob_diff"] < 1e-4 for r in rows if "loss/policy" in r)
    assert all(r["mismatch/same_weights_abs_max"] < 1e-4 for r in rows if r.get("mismatch/same_weights_tokens"))
    assert any(r.get("mismatch/same_weights_tokens") for r in rows)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["completion"] and s["prompt"].endswith("=") for s in samples)
    trainer_state, controller_state, _ = load_states(latest_checkpoint(run / "checkpoints"))
    assert trainer_state["version"] == 3
    ledger = controller_state["scheduler"]["ledger"]
    assert ledger  # the exactly-once ledger travels with every checkpoint

    # `flashreinforce eval RUN_DIR` scores the latest checkpoint on the run's own held-out split
    main(["eval", str(run), "--k", "2", "--num-prompts", "4", "--json", str(tmp_path / "eval.json")])
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["model"].endswith("step_000003/model")
    assert report["num_prompts"] == 4 and report["k"] == 2
    assert 0 <= report["eval/pass@1"] <= report["eval/pass@2"] <= 100


@pytest.mark.parametrize(
    "overrides",
    [
        ["scheduler.kind=sync"],
        pytest.param(["scheduler.kind=april"], marks=pytest.mark.slow),
        ["scheduler.kind=urb"],
        ["scheduler.kind=stream", "scheduler.stale_policy=drop"],
        ["algo.loss=grpo", "scheduler.group_size=4", "scheduler.batch_groups=2"],
        pytest.param(["algo.loss=gspo", "scheduler.group_size=2", "scheduler.batch_groups=4", "scheduler.kind=urb"],
                     marks=pytest.mark.slow),
        pytest.param(["algo.loss=dapo", "scheduler.group_size=4", "scheduler.batch_groups=2",
                      "algo.dynamic_sampling=true", "algo.overlong={max_length: 40, cache: 10}"],
                     marks=pytest.mark.slow),  # dynamic sampling: ~10 s of regenerated groups
        pytest.param(["algo.loss=misc", "scheduler.group_size=2", "scheduler.batch_groups=4",
                      "algo.wpsm={tau: 0.2, eta: 0.5}", "scheduler.kind=april", "scheduler.mask_offpolicy=true"],
                     marks=pytest.mark.slow),
    ],
    ids=["sync", "april", "urb", "stream-drop", "grpo", "gspo-urb", "dapo", "misc-wpsm-april"],
)
def test_every_scheduler_and_group_loss_trains(tiny_run, tmp_path, overrides):
    config = load_config(None, [*tiny_run, "trainer.steps=2", "eval.num_prompts=4", "log.tensorboard=false",
                                *overrides])
    summary = run_training(config, run_dir=tmp_path / "run")
    assert summary["optimizer_steps"] == 2
    assert summary["trained_trajectories"] == 2 * config.scheduler.batch_groups * config.scheduler.group_size or \
        config.algo.dynamic_sampling


def test_sft_command_saves_a_loadable_warm_start_and_scores_it(tiny_run, tmp_path):
    sft_overrides = [o for o in tiny_run if not o.startswith(("trainer.", "scheduler."))]
    main(["sft", *sft_overrides, "--output", str(tmp_path / "warm")])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "warm" / "sft")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "warm" / "sft")
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("<think>1+2=3;</think>3"))[0] == "<think>"
    report = json.loads((tmp_path / "warm" / "sft_eval.json").read_text())
    assert report["model"].endswith("sft") and "eval/avg@k" in report


@pytest.mark.slow  # waits out verifier timeouts; the pool's own tests cover raise, hang and crash in unit size
def test_a_reward_function_that_raises_or_hangs_is_counted_and_the_run_goes_on(tiny_run, tmp_path):
    rewards = tmp_path / "flaky_rewards.py"
    rewards.write_text(
        "import time\n"
        "def reward(completion, ground_truth, prompt):\n"
        "    n = int(prompt.id.rsplit('/', 1)[1])\n"
        "    if n % 3 == 0:\n"
        "        raise RuntimeError('boom')\n"
        "    if n % 3 == 1:\n"
        "        time.sleep(30)\n"
        "    return completion.endswith(ground_truth)\n"
    )
    config = load_config(None, [*tiny_run, "trainer.steps=2", "eval.num_prompts=3", "eval.k=1",
                                f"verifier.reward_fn={rewards}:reward", "verifier.timeout_s=0.3",
                                "verifier.max_workers=2", "log.tensorboard=false"])
    summary = run_training(config, run_dir=tmp_path / "run")
    assert summary["optimizer_steps"] == 2 and summary["trained_trajectories"] == 16
    reasons = summary["verifier"]
    assert reasons.get("reason/timeout", 0) > 0, reasons
    assert any(k.startswith("reason/error") and v > 0 for k, v in reasons.items()), reasons


def test_ahrl_hints_reach_the_engine_and_never_the_loss(tiny_run, tmp_path):
    config = load_config(None, [*tiny_run, "trainer.steps=2", "data.arithmetic.num_train=40", "log.tensorboard=false",
                                "algo.hints={p_initial: 0.9, gamma: 0.001, k: 1, samples: 2, pass_threshold: 1.0}"])
    run_training(config, run_dir=tmp_path / "run")
    run = tmp_path / "run"
    pass_initial = json.loads((run / "pass_initial.json").read_text())
    assert len(pass_initial) == 40 and all(0 <= v <= 1 for v in pass_initial.values())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss/policy" in r]
    assert all(r["hints/hinted_fraction"] == 1.0 and r["hints/mean_tokens"] > 1 for r in trained)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert all(s["prompt"].split("=", 1)[1].startswith("<think>") for s in samples)  # prompt, then opener + hint


def test_a_hinted_rollout_keeps_the_whole_generation_budget(tiny_run, tmp_path):
    """The engine's context is sized for the longest hinted prompt, so even a whole think revealed (p_initial 1)
    leaves every rollout rollout.max_new_tokens new tokens; a hint used to eat them, then crash the run."""
    config = load_config(None, [*tiny_run, "trainer.steps=2", "data.arithmetic.num_train=40", "log.tensorboard=false",
                                "rollout.max_new_tokens=4", "trainer.checkpoint_every=0",
                                "algo.hints={p_initial: 1.0, gamma: 0.0, k: 1, samples: 1, pass_threshold: 1.0}"])
    run_training(config, run_dir=tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss/policy" in r]
    assert len(trained) == 2 and all(r["hints/hinted_fraction"] == 1.0 for r in trained)
    # the whole think is in the prompt, yet the answer has room: 4 tokens, none taken by the hint
    assert max(r["response/length_max"] for r in trained) == 4


def _count_pauses(monkeypatch) -> list[int]:
    from flashreinforce.controller.local import LocalBackend

    pauses = []
    original = LocalBackend.pause

    async def counting_pause(self):
        pauses.append(self.trainer.version)
        return await original(self)

    monkeypatch.setattr(LocalBackend, "pause", counting_pause)
    return pauses


@pytest.mark.parametrize("kind", ["stream", pytest.param("urb", marks=pytest.mark.slow)])
def test_in_flight_updates_push_without_pausing_and_keep_the_lag_bound(tiny_run, tmp_path, monkeypatch, kind):
    pauses = _count_pauses(monkeypatch)
    config = load_config(None, [*tiny_run, "trainer.steps=5", "trainer.checkpoint_every=0", "eval.every=0",
                                "log.tensorboard=false", f"scheduler.kind={kind}"])
    assert config.rollout.in_flight_updates  # the default
    summary = run_training(config, run_dir=tmp_path / "run")
    assert summary["optimizer_steps"] == 5 and summary["trained_trajectories"] == 5 * 8
    assert pauses == [5]  # only for the final checkpoint
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss/policy" in r]
    assert max(r["lag/max"] for r in trained) <= 1  # S = 1 and N = 2: a token is at most one step old
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples


def test_without_in_flight_updates_every_push_pauses(tiny_run, tmp_path, monkeypatch):
    pauses = _count_pauses(monkeypatch)
    config = load_config(None, [*tiny_run, "trainer.steps=3", "trainer.checkpoint_every=0", "eval.every=0",
                                "log.tensorboard=false", "rollout.in_flight_updates=false"])
    run_training(config, run_dir=tmp_path / "run")
    assert pauses == [1, 2, 3]



def test_chat_message_prompts_train_with_a_chat_template_model(chat_tokenizer, tiny_run, tmp_path):
    """A Hugging Face model directory with a ChatML tokenizer and data whose prompts are chat messages."""
    from flashreinforce.models import build_model

    model_dir = tmp_path / "chat-model"
    build_model(len(chat_tokenizer), 32, 1, 2, 128, pad_token_id=chat_tokenizer.pad_token_id,
                eos_token_id=chat_tokenizer.eos_token_id).save_pretrained(model_dir)
    chat_tokenizer.save_pretrained(model_dir)
    rows = [{"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "reward_model": {"ground_truth": str(a + b)}}
            for a in range(4) for b in range(4)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = load_config(None, [*tiny_run, f"model.path={model_dir}", "data.kind=files", f"data.train={data}",
                                f"data.eval={data}", "scheduler.batch_groups=4", "trainer.steps=2",
                                "rollout.max_new_tokens=6", "eval.num_prompts=4", "log.tensorboard=false"])
    summary = run_training(config, run_dir=tmp_path / "run")
    assert summary["optimizer_steps"] == 2 and summary["trained_trajectories"] == 8
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples
    for sample in samples:  # ids "chat/<row>": the prompt decodes back to exactly what the template renders
        messages = rows[int(sample["prompt_id"].split("/")[1])]["prompt"]
        assert sample["prompt"] == chat_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                      tokenize=False)


def test_held_out_evaluation_decodes_the_same_on_the_threaded_and_the_lockstep_engine(tiny_run):
    """The engine thread of the overlapped backend decodes an evaluation exactly as the lockstep backend does:
    the same tokens with the same log-probs, to the bit, run after run (a checkpoint always scores the same)."""
    import asyncio

    from flashreinforce.controller.local import LocalBackend
    from flashreinforce.eval.evaluate import evaluate
    from flashreinforce.run.backends import build_episodes, build_verifier_pool
    from flashreinforce.run.data import load_data
    from flashreinforce.run.engines import EngineShape, build_engine, eval_params, longest_rendered
    from flashreinforce.run.policy import tiny_policy

    class Recording(LocalBackend):
        async def finished(self):
            done = await super().finished()
            self.seen.update((g.request_id, (g.token_ids, g.behavior_logprobs)) for g in done)
            return done

    config = load_config(None, [*tiny_run, "rollout.max_batch_size=8"])  # continuous batching: slots refill
    policy, prompts = tiny_policy(config), load_data(config).eval[:16]
    episodes = build_episodes(config, policy.tokenizer)
    shape = EngineShape(longest_rendered(episodes, prompts), 24, version=0, seed=0)

    async def decode(overlap: bool) -> dict:
        with build_verifier_pool(config) as pool:
            backend = Recording(build_engine(config, policy, shape), None, pool, policy.tokenizer, overlap=overlap)
            backend.seen = {}
            await evaluate(backend, episodes, prompts, k=4, params=eval_params(config, 24), seed=0)
            await backend.close()
        return backend.seen

    lockstep = asyncio.run(decode(overlap=False))
    assert len(lockstep) == 16 * 4
    for _ in range(3):
        assert asyncio.run(decode(overlap=True)) == lockstep


@pytest.mark.slow
def test_the_own_model_recipe_trains_a_hugging_face_model_on_chat_rows(save_chat_model, tmp_path):
    """The recipe the README gives for one's own model and data, as shipped (bf16, gradient checkpointing, the
    reference lr), on a small saved model with its budgets cut to a test's size."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "reward_model": {"ground_truth": str(a + b)},
             "data_source": "sums"} for a in range(4) for b in range(4)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = load_config("own_model", [f"model.path={save_chat_model(32, 2)}", f"data.train={data}",
                                       f"data.eval={data}", "rollout.max_new_tokens=8", "scheduler.batch_groups=4",
                                       "trainer.steps=2", "eval.num_prompts=4", "eval.k=1", "eval.every=0",
                                       "log.progress=false", "log.tensorboard=false", "verifier.max_workers=1"])
    assert (config.trainer.lr, config.precision.trainer, config.trainer.gradient_checkpointing) == (1e-6, "bf16", True)
    summary = run_training(config, run_dir=tmp_path / "run")
    assert summary["optimizer_steps"] == 2 and summary["trained_trajectories"] == 8
