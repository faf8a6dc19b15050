"""The fused decoding step (rollout/fused_decode.py) against the model's own forward: the same tokens, and log-probs
within a rounding of the last fp32 bit in fp32 and of a bf16 logit in bf16, through pauses and weight pushes, the
model's forward splitting long and short rows; equal to the trainer's recompute; and a clean fallback, with its
reason, wherever it cannot run."""

import copy
import ctypes

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


def recompute_gaps(model, generations) -> torch.Tensor:
    """|behavior - recomputed log-prob| of every sampled token, each sequence through `model` whole."""
    gaps = []
    for generation in generations:
        with torch.no_grad():
            ids = torch.tensor([generation.prompt_ids + generation.token_ids])
            recomputed, _ = token_logprobs(model, ids, with_entropy=False)
        behavior = torch.tensor(generation.behavior_logprobs)
        gaps.append((recomputed[0, len(generation.prompt_ids):].float() - behavior).abs())
    return torch.cat(gaps)


@pytest.mark.parametrize("name", ["llama", "mistral"])  # (this Qwen2 config's full forward wants a window)
def test_in_bf16_the_fused_step_is_as_close_to_the_recompute_as_the_model_forward(name, built_kernels):
    """The attention adds in its own order: a bf16 logit may differ from the model forward's by a rounding, and
    once a sampled token differs the generations part. Until then the log-probs agree within that rounding, and
    the fused step's gap to the trainer's bf16 recompute (what the policy gate sees) is the model forward's."""
    model = served_model(name)
    numerics = Numerics(precision="bf16")
    fused, own = run(model, True, numerics), run(model, False, numerics)
    assert fused.keys() == own.keys()
    for request_id, generation in fused.items():
        theirs = own[request_id]
        agreed = next((i for i, (a, b) in enumerate(zip(generation.token_ids, theirs.token_ids)) if a != b),
                      len(generation.token_ids))
        gaps = torch.tensor(generation.behavior_logprobs[:agreed]) - torch.tensor(theirs.behavior_logprobs[:agreed])
        assert agreed > 0 and gaps.abs().max() <= 1e-2
    recompute = copy.deepcopy(model).to(torch.bfloat16)
    fused_gap, own_gap = recompute_gaps(recompute, fused.values()), recompute_gaps(recompute, own.values())
    assert fused_gap.mean() <= 2 * own_gap.mean() + 1e-4 and fused_gap.max() <= 2 * own_gap.max() + 1e-3


def test_fused_behavior_logprobs_equal_the_trainer_recompute(built_kernels):
    model = served_model("llama")
    assert recompute_gaps(model, run(model, True).values()).max() <= 1e-5


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


@pytest.mark.parametrize("slots", [1, 4, 6, 128])
def test_products_run_at_a_few_row_counts_each_at_least_its_rows(slots):
    """oneDNN keeps a kernel per row count in a bounded cache: a decoding step's products (1 to `slots` rows) run at
    the powers of two up to the slots, a prefill's at multiples of them, never more than twice the rows."""
    decode = {n: fused_decode.row_bucket(n, slots) for n in range(1, slots + 1)}
    prefill = {n: fused_decode.row_bucket(n, slots) for n in range(slots + 1, fused_decode.PREFILL_CHUNK + 1)}
    assert set(decode.values()) == {min(2 ** k, slots) for k in range((slots - 1).bit_length() + 1)}
    assert set(prefill.values()) <= set(range(2 * slots, fused_decode.PREFILL_CHUNK + slots, slots))
    assert all(n <= bucket < 2 * n for n, bucket in (decode | prefill).items())


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


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (n, heads, dim) rotary-embedded as the model does it, rounding after each operation in x's dtype."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def attention_case(dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> dict:
    """Rows in scattered slots at positions 0..57: one key, keys within a block of 16, across blocks, a partial one."""
    generator = torch.Generator().manual_seed(dim + heads)
    slots, positions = torch.tensor([2, 0, 5, 3]), torch.tensor([0, 11, 57, 31])
    n, capacity = len(slots), 64
    keys, values = (torch.randn(6, kv_heads, capacity, dim, generator=generator).to(dtype) for _ in range(2))
    angles = torch.rand(n, 1, dim // 2, generator=generator) * 6
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))  # (n, 1, dim)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    return {"qkv": qkv, "cos": cos, "sin": sin, "keys": keys, "values": values, "slots": slots,
            "positions": positions, "heads": heads, "kv_heads": kv_heads, "dim": dim, "scale": dim ** -0.5}


def run_attention(library, case: dict, threads: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    keys, values = case["keys"].clone(), case["values"].clone()
    qkv = case["qkv"]
    out = qkv.new_empty(qkv.shape[0], case["heads"] * case["dim"])
    code = fused_decode._DTYPE_CODES[qkv.dtype]
    failed = library.decode_attention(
        code, qkv.data_ptr(), case["cos"].data_ptr(), case["sin"].data_ptr(), keys.data_ptr(), values.data_ptr(),
        case["slots"].data_ptr(), case["positions"].data_ptr(), out.data_ptr(), qkv.shape[0], case["heads"],
        case["kv_heads"], case["dim"], keys.shape[2], case["scale"], threads)
    assert failed == 0
    return out, keys, values


def reference_attention(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the kernel should store and return: the rotated key and the value at each row's slot and position, and
    each row's queries attending in float64 to that slot's positions up to its own (query heads h * group + g
    sharing KV head h)."""
    heads, kv_heads, dim = case["heads"], case["kv_heads"], case["dim"]
    n = case["qkv"].shape[0]
    q, k, v = case["qkv"].view(n, heads + 2 * kv_heads, dim).split([heads, kv_heads, kv_heads], dim=1)
    q, k = rotated(q, case["cos"], case["sin"]), rotated(k, case["cos"], case["sin"])
    keys, values = case["keys"].clone(), case["values"].clone()
    out = torch.empty(n, heads, dim, dtype=torch.float64)
    for row, (slot, position) in enumerate(zip(case["slots"].tolist(), case["positions"].tolist())):
        keys[slot, :, position], values[slot, :, position] = k[row], v[row]
        for head in range(heads):
            kv = head // (heads // kv_heads)
            seen_keys, seen_values = keys[slot, kv, : position + 1].double(), values[slot, kv, : position + 1].double()
            weights = torch.softmax(seen_keys @ q[row, head].double() * case["scale"], dim=0)
            out[row, head] = weights @ seen_values
    return out.view(n, heads * dim), keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (10, 2, 32), (4, 4, 128), (6, 2, 40)])
def test_the_attention_kernel_stores_each_rows_key_and_attends_to_its_own_positions(dtype, heads, kv_heads, dim,
                                                                                    built_kernels):
    """Grouped queries of 3 and 5 heads a KV head (more than the 4 the vector path keeps in registers at once), no
    grouping, and a head width that is not a multiple of 16 (the scalar path); rows in scattered slots, lengths of
    1 to 58 keys. The new keys and values are stored bit for bit; the output is float64 attention's within
    fp32 rounding, or within a bf16 rounding of the output and of the softmax's weights."""
    case = attention_case(dtype, heads, kv_heads, dim)
    out, keys, values = run_attention(fused_decode.kernels(), case)
    expected, expected_keys, expected_values = reference_attention(case)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - expected).abs().max() <= tolerance


def test_the_portable_attention_equals_the_vectorized_one(built_kernels, tmp_path):
    """Built without AVX-512 (a CPU without it, another architecture), the kernel takes its plain C loops: the same
    results within fp32 rounding, the same keys and values bit for bit."""
    vectorized = fused_decode.kernels()
    portable_path = tmp_path / "portable.so"
    try:
        fused_decode._build(fused_decode._SOURCE, portable_path, ("-mno-avx512f",))
    except fused_decode.KernelsUnavailable as error:
        pytest.skip(f"this compiler cannot build without AVX-512 ({error})")
    portable = fused_decode.declared(ctypes.CDLL(str(portable_path)))
    for dtype in (torch.float32, torch.bfloat16):
        case = attention_case(dtype, 9, 3, 64)
        (out, keys, values), (plain, plain_keys, plain_values) = run_attention(vectorized, case), run_attention(
            portable, case, threads=1)
        assert torch.equal(keys, plain_keys) and torch.equal(values, plain_values)
        assert (out.float() - plain.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 1.6e-2)


def test_a_prefill_cut_into_chunks_mid_prompt_stores_what_one_forward_does(monkeypatch, built_kernels):
    """Chunks of 7 tokens cut the prefilled prompts (9 to 30 tokens) mid-way: each chunk's tokens read the keys the
    earlier chunks stored, so the generations are those of whole-prompt prefills."""
    model = served_model("llama")
    whole = run(model, True)
    monkeypatch.setattr(fused_decode, "PREFILL_CHUNK", 7)
    chunked = run(model, True)
    for request_id, generation in chunked.items():
        assert generation.token_ids == whole[request_id].token_ids
        gaps = torch.tensor(generation.behavior_logprobs) - torch.tensor(whole[request_id].behavior_logprobs)
        assert gaps.abs().max() <= 2e-6
