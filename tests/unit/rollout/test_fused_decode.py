"""The fused decoding step (rollout/fused_decode.py) against the model's own forward: the same tokens and the same
log-probs bit for bit in bf16, within a rounding of the last fp32 bit in fp32, through split steps, pauses and weight
pushes; equal to the trainer's recompute; and a clean fallback, with its reason, wherever it cannot run."""

import copy

import pytest
import torch
import transformers as tf
from model_families import VOCAB, tiny_family_model

from flashreinforce.models import token_logprobs
from flashreinforce.models.numerics import Numerics
from flashreinforce.rollout import Engine, fused_decode
from flashreinforce.types import SamplingParams

# Plain full-attention configurations of the layer classes the fused step serves, with biases where the class has
# them (Llama's optional attention and MLP biases, Qwen2's q/k/v biases) and one model without grouped queries.
SERVED = {
    "llama": {"attention_bias": True, "mlp_bias": True},
    "llama-mha": {"num_key_value_heads": 4},
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False, "sliding_window": None},
}


@pytest.fixture
def built_kernels():
    """The kernels need a C compiler (CI installs gcc); without one the tests that need them skip, saying why."""
    try:
        fused_decode.kernels()
    except fused_decode.KernelsUnavailable as error:
        pytest.skip(f"the fused decoding kernels cannot be built here: {error}")


def served_model(name: str) -> tf.PreTrainedModel:
    return tiny_family_model(name.split("-")[0], **SERVED[name])


def run(model, fused: bool, numerics: Numerics | None = None, push: dict | None = None) -> dict:
    """Seeded requests of mixed lengths, long and short rows split into two forwards, a pause and resume midway
    and optionally a weight push at step 5; generations by request id."""
    engine = Engine(copy.deepcopy(model), max_batch_size=4, max_context=96, eos_token_ids=(), prefill_threshold=6,
                    split_min_saving=0, numerics=numerics, fused_decode=fused)
    assert (engine.fused_decode_off is None) == fused
    generator = torch.Generator().manual_seed(3)
    for i, length in enumerate((2, 17, 5, 30, 9, 3)):
        prompt = torch.randint(2, VOCAB, (length,), generator=generator).tolist()
        engine.submit(f"r{i}", prompt, SamplingParams(max_new_tokens=12 + 5 * i, seed=i))
    done, step = [], 0
    while engine.has_work:
        if step == 5 and push is not None:
            engine.load_weights(push, version=1)
        if step == 8:
            for partial in engine.pause():
                engine.submit(partial.request_id, partial.prompt_ids, partial.params, prefix=partial)
        done += engine.step()
        step += 1
    return {g.request_id: g for g in done}


def perturbed_state(model) -> dict:
    generator = torch.Generator().manual_seed(9)
    return {name: t + 0.05 * torch.randn(t.shape, generator=generator).to(t.dtype)
            for name, t in model.state_dict().items()}


@pytest.mark.parametrize("name", sorted(SERVED))
def test_fused_steps_give_the_model_forwards_tokens_and_logprobs(name, built_kernels):
    model = served_model(name)
    push = perturbed_state(model)
    fused, own = run(model, True, push=push), run(model, False, push=push)
    assert fused.keys() == own.keys()
    for request_id, generation in fused.items():
        assert generation.token_ids == own[request_id].token_ids
        assert generation.policy_versions == own[request_id].policy_versions
        gaps = torch.tensor(generation.behavior_logprobs) - torch.tensor(own[request_id].behavior_logprobs)
        assert gaps.abs().max() <= 2e-6


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_in_bf16_the_fused_step_is_the_model_forward_bit_for_bit(name, built_kernels):
    model = served_model(name)
    numerics = Numerics(precision="bf16")
    fused, own = run(model, True, numerics), run(model, False, numerics)
    for request_id, generation in fused.items():
        assert generation.token_ids == own[request_id].token_ids
        assert generation.behavior_logprobs == own[request_id].behavior_logprobs


def test_fused_behavior_logprobs_equal_the_trainer_recompute(built_kernels):
    model = served_model("llama")
    for generation in run(model, True).values():
        with torch.no_grad():
            ids = torch.tensor([generation.prompt_ids + generation.token_ids])
            recomputed, _ = token_logprobs(model, ids, with_entropy=False)
        behavior = torch.tensor(generation.behavior_logprobs)
        assert (recomputed[0, len(generation.prompt_ids):] - behavior).abs().max() <= 1e-5


def test_weights_changed_in_place_or_replaced_are_repacked(built_kernels):
    """The products run on packed copies of the weights: a push (in place), a cast (new tensors) or a hand edit
    of one parameter changes what the fused step computes, as it changes the model's own forward."""
    model = served_model("llama")
    engine = Engine(copy.deepcopy(model), max_batch_size=2, max_context=32, fused_decode=True)
    assert engine.model.state_dict().keys() == model.state_dict().keys()
    engine.load_weights(perturbed_state(model), version=1)
    engine.model.to(torch.float64).to(torch.float32)
    with torch.no_grad():
        engine.model.model.layers[1].mlp.down_proj.weight.mul_(3.0)
    reference = Engine(copy.deepcopy(engine.model), max_batch_size=2, max_context=32, fused_decode=False)
    outputs = []
    for e in (engine, reference):
        e.submit("a", [3, 4, 5, 6], SamplingParams(max_new_tokens=8, seed=1))
        while e.has_work:
            outputs += e.step()
    assert outputs[0].token_ids == outputs[1].token_ids
    assert max(abs(a - b) for a, b in zip(outputs[0].behavior_logprobs, outputs[1].behavior_logprobs)) <= 2e-6


@pytest.mark.parametrize("size", [1, 7, 64, 576, 1000, 4097, 16411])
def test_ordered_sums_add_in_the_order_of_this_torch(size, built_kernels):
    """The norm's sum of squares adds as torch's own sum does, for sizes that reach each of its cascade levels
    (up to hidden sizes of 16k: a single longer row, torch would split between threads)."""
    lanes = fused_decode.sum_lanes(576)
    assert lanes in (16, 8, 4, 1)
    library = fused_decode.kernels()
    generator = torch.Generator().manual_seed(size)
    values = torch.randn(size, generator=generator) * torch.logspace(-4, 4, size)
    assert library.ordered_sum(values.data_ptr(), size, lanes) == values.sum().item()


def test_models_the_fused_step_does_not_serve_take_their_own_forward_and_say_why(built_kernels):
    windowed = tiny_family_model("mistral")  # a sliding window
    engine = Engine(windowed, max_batch_size=2, max_context=32)
    assert engine.fused_decode_off is not None and "sliding windows" in engine.fused_decode_off
    gemma = tiny_family_model("gemma")
    assert "not among" in Engine(gemma, max_batch_size=2, max_context=32).fused_decode_off
    eager = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4,
                                               attn_implementation="eager"))
    with pytest.raises(ValueError, match="fused_decode=True: attention 'eager'"):
        Engine(eager, max_batch_size=2, max_context=32, fused_decode=True)
    assert Engine(served_model("llama"), max_batch_size=2, max_context=32, fused_decode=False).fused_decode_off


def test_without_a_compiler_the_engine_falls_back_naming_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHREINFORCE_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    fused_decode.kernels.cache_clear()
    try:
        engine = Engine(served_model("llama"), max_batch_size=2, max_context=32)
        assert "did not run" in engine.fused_decode_off and "set $CC" in engine.fused_decode_off
        engine.submit("a", [3, 4, 5], SamplingParams(max_new_tokens=4, seed=0))
        assert sum(len(g.token_ids) for _ in range(6) for g in engine.step()) == 4
        with pytest.raises(ValueError, match="fused_decode=True"):
            Engine(served_model("llama"), max_batch_size=2, max_context=32, fused_decode=True)
    finally:
        fused_decode.kernels.cache_clear()


def test_an_unwritable_cache_directory_falls_back_naming_the_setting(monkeypatch, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("FLASHREINFORCE_CACHE", str(blocked))  # kernels/ cannot be made under a file
    fused_decode.kernels.cache_clear()
    try:
        engine = Engine(served_model("llama"), max_batch_size=2, max_context=32)
        assert "FLASHREINFORCE_CACHE" in engine.fused_decode_off
    finally:
        fused_decode.kernels.cache_clear()
