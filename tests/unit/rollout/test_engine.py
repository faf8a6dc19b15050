from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from flashreinforce.models import build_char_tokenizer, build_model, token_logprobs
from flashreinforce.rollout import Engine, append_forced_tokens
from flashreinforce.rollout.engine import length_split
from flashreinforce.rollout.sampling import processed_logprobs
from flashreinforce.types import FORCED_VERSION, SamplingParams

VOCAB = 16


def sharp_model(seed=0, scale=8.0):
    """A tiny model with peaked next-token distributions, so different weights give different tokens."""
    model = build_model(VOCAB, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=128, seed=seed)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(scale)  # tied: scales the logits too
    return model


@pytest.fixture(scope="module")
def model():
    return sharp_model()


def run(engine):
    """Step until every request has come back; returns {request_id: Generation}."""
    out = {}
    while engine.has_work:
        for generation in engine.step():
            out[generation.request_id] = generation
    return out


def submit_mix(engine, n=7, **params):
    """Requests with different prompt lengths and budgets (so they finish at different steps)."""
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        prompt = torch.randint(1, VOCAB, (2 + 3 * i % 7,), generator=g).tolist()
        engine.submit(f"r{i}", prompt, SamplingParams(max_new_tokens=3 + 5 * i % 11, seed=i, **params))


def recomputed_logits(model, generation):
    """Teacher-forced logits (len(tokens), V) that predicted each generated token."""
    ids = torch.tensor([generation.prompt_ids + generation.token_ids])
    with torch.no_grad():
        return model(ids).logits[0, len(generation.prompt_ids) - 1 : -1]


@pytest.mark.parametrize("prefill_threshold", [0, 100])
def test_behavior_logprobs_equal_the_trainer_recompute(model, prefill_threshold):
    # 7 requests through 3 slots: requests join and leave, slots are compacted; fp32, T = 1, no truncation.
    engine = Engine(model, max_batch_size=3, max_context=64, prefill_threshold=prefill_threshold)
    submit_mix(engine)
    out = run(engine)
    assert len(out) == 7
    for g in out.values():
        assert g.finish_reason == "length" and len(g.token_ids) == g.params.max_new_tokens
        recomputed, _ = token_logprobs(model, torch.tensor([g.prompt_ids + g.token_ids]), with_entropy=False)
        mismatch = (recomputed[0, len(g.prompt_ids) :] - torch.tensor(g.behavior_logprobs)).abs().max()
        assert mismatch < 1e-5, (g.request_id, mismatch)
        assert set(g.policy_versions) == {0} and set(g.loss_mask) == {1}
    stats = engine.stats
    assert stats.sampled_tokens == sum(len(g.token_ids) for g in out.values())
    assert stats.available_slot_steps == 3 * stats.steps and 0 < stats.busy_slot_steps <= stats.available_slot_steps


def test_truncated_sampling_logprobs_match_the_recomputed_processed_distribution(model):
    engine = Engine(model, max_batch_size=4, max_context=64)
    params = dict(temperature=0.7, top_k=5, top_p=0.9, return_policy_logprobs=True)
    submit_mix(engine, n=5, **params)
    for g in run(engine).values():
        logits = recomputed_logits(model, g)  # (n, V)
        n = len(logits)
        processed = processed_logprobs(logits, torch.full((n,), 0.7), torch.full((n,), 5), torch.full((n,), 0.9))
        expected = processed.gather(1, torch.tensor(g.token_ids)[:, None]).squeeze(1)
        assert torch.isfinite(expected).all()  # no truncated token was drawn
        assert (expected - torch.tensor(g.behavior_logprobs)).abs().max() < 1e-5
        untruncated = torch.log_softmax(logits, -1).gather(1, torch.tensor(g.token_ids)[:, None]).squeeze(1)
        assert (untruncated - torch.tensor(g.policy_logprobs)).abs().max() < 1e-5


def test_empirical_frequencies_match_the_processed_distribution():
    model = sharp_model(scale=4.0)  # top probabilities ~0.26, 0.08, 0.07, ...
    prompt, n = [3, 7, 1], 3000
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1:]
    processed = processed_logprobs(logits, torch.tensor([1.3]), torch.tensor([6]), torch.tensor([0.75]))[0]
    kept = torch.isfinite(processed)
    assert 3 <= kept.sum() <= 6
    engine = Engine(model, max_batch_size=500, max_context=8)
    params = [SamplingParams(max_new_tokens=1, temperature=1.3, top_k=6, top_p=0.75, seed=s) for s in range(n)]
    for s in range(n):
        engine.submit(f"s{s}", prompt, params[s])
    counts = torch.bincount(torch.tensor([g.token_ids[0] for g in run(engine).values()]), minlength=VOCAB).double()
    assert counts[~kept].sum() == 0
    expected = n * processed[kept].double().exp()
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum()
    df = torch.tensor((int(kept.sum()) - 1) / 2, dtype=torch.float64)
    assert torch.special.gammaincc(df, chi2 / 2) > 1e-3


def test_a_request_gets_the_same_tokens_alone_or_batched(model):
    greedy, sampled = SamplingParams(max_new_tokens=12, temperature=0.0), SamplingParams(max_new_tokens=12, seed=5)
    alone = {}
    for request_id, params in (("greedy", greedy), ("sampled", sampled)):
        engine = Engine(model, max_batch_size=4, max_context=64)
        engine.submit(request_id, [4, 2, 9], params)
        alone.update(run(engine))
    engine = Engine(model, max_batch_size=4, max_context=64)
    engine.submit("long-prompt", [1] * 20, SamplingParams(max_new_tokens=30, seed=1))
    engine.step()
    engine.step()
    engine.submit("greedy", [4, 2, 9], greedy)
    engine.submit("short", [5], SamplingParams(max_new_tokens=2, seed=2))
    engine.submit("sampled", [4, 2, 9], sampled)
    batched = run(engine)
    assert batched["greedy"].token_ids == alone["greedy"].token_ids
    assert set(alone["greedy"].behavior_logprobs) == {0.0}  # a point mass
    assert batched["sampled"].token_ids == alone["sampled"].token_ids
    assert batched["sampled"].token_ids != batched["greedy"].token_ids


@pytest.mark.parametrize("prefill_threshold", [0, 100])
def test_pause_and_resume_gives_the_tokens_of_an_uninterrupted_run(model, prefill_threshold):
    def engine():
        return Engine(model, max_batch_size=3, max_context=64, prefill_threshold=prefill_threshold)

    reference = engine()
    submit_mix(reference, top_k=6)
    expected = run(reference)

    interrupted, out = engine(), {}
    submit_mix(interrupted, top_k=6)
    for pause_after in (4, 3):  # two pauses, with requests waiting, running and finished
        for _ in range(pause_after):
            out.update((g.request_id, g) for g in interrupted.step())
        partials = interrupted.pause()
        assert interrupted.num_running == interrupted.num_waiting == 0
        assert {p.finish_reason for p in partials} == {"abort"}
        for p in partials:
            interrupted.submit(p.request_id, p.prompt_ids, p.params, prefix=p)
    out.update(run(interrupted))
    assert out.keys() == expected.keys()
    for request_id, g in out.items():
        assert g.token_ids == expected[request_id].token_ids
        assert g.policy_versions == expected[request_id].policy_versions
        torch.testing.assert_close(g.behavior_logprobs, expected[request_id].behavior_logprobs, rtol=0, atol=1e-5)


def test_load_weights_between_steps_switches_the_version_of_later_tokens(model):
    params = SamplingParams(max_new_tokens=20, seed=3)
    reference = Engine(model, max_batch_size=2, max_context=64)
    reference.submit("a", [1, 2, 3], params)
    expected = run(reference)["a"]

    engine = Engine(sharp_model(), max_batch_size=2, max_context=64)
    engine.submit("a", [1, 2, 3], params)
    for _ in range(8):  # 2 steps read the prompt, 6 sample
        engine.step()
    engine.load_weights(sharp_model(seed=1).state_dict(), version=1)
    assert engine.version == 1
    got = run(engine)["a"]
    assert got.policy_versions == (0,) * 6 + (1,) * 14
    assert got.token_ids[:6] == expected.token_ids[:6]
    assert got.token_ids[6:] != expected.token_ids[6:]


def test_load_weights_rejects_mismatched_state_dicts(model):
    engine = Engine(sharp_model(), max_batch_size=2, max_context=64, version=3)
    state = model.state_dict()
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights({k: v for k, v in state.items() if k != "model.norm.weight"}, 4)
    with pytest.raises(ValueError, match="unexpected"):
        engine.load_weights({**state, "extra.weight": torch.zeros(1)}, 4)
    with pytest.raises(ValueError, match="wrong shapes"):
        engine.load_weights({**state, "model.norm.weight": torch.zeros(5)}, 4)
    with pytest.raises(ValueError, match="older"):
        engine.load_weights(state, 2)


def test_forced_tokens_are_masked_and_the_request_continues_after_them(model):
    engine = Engine(model, max_batch_size=2, max_context=64)
    engine.submit("turns", [5, 6], SamplingParams(max_new_tokens=4, seed=0))
    first = run(engine)["turns"]
    with_observation = append_forced_tokens(first, [9, 9, 8])
    assert with_observation.loss_mask == (1, 1, 1, 1, 0, 0, 0)
    assert with_observation.policy_versions[4:] == (FORCED_VERSION,) * 3
    engine.submit("turns", [5, 6], SamplingParams(max_new_tokens=10, seed=0), prefix=with_observation)
    second = run(engine)["turns"]
    assert second.token_ids[:7] == with_observation.token_ids and len(second.token_ids) == 10
    assert second.loss_mask == (1, 1, 1, 1, 0, 0, 0, 1, 1, 1)
    assert second.behavior_logprobs[:7] == with_observation.behavior_logprobs
    recomputed, _ = token_logprobs(model, torch.tensor([second.prompt_ids + second.token_ids]), with_entropy=False)
    assert (recomputed[0, 2 + 7 :] - torch.tensor(second.behavior_logprobs[7:])).abs().max() < 1e-5


def test_stop_tokens_stop_strings_and_limits():
    tokenizer = build_char_tokenizer("abcdefghijk")  # 5 special tokens + 11 letters = VOCAB
    model = sharp_model()
    seeded = SamplingParams(max_new_tokens=12, seed=11)  # the same tokens in every run and batch
    probe = Engine(model, max_batch_size=1, max_context=64)
    probe.submit("probe", [7, 8], seeded)
    free = run(probe)["probe"].token_ids  # what the request samples when nothing stops it
    stop_at = next(j for j in range(1, 12) if free[j] not in free[:j])  # a token not seen before

    engine = Engine(model, max_batch_size=4, max_context=64, eos_token_ids=free[stop_at], tokenizer=tokenizer)
    engine.submit("eos", [7, 8], seeded)
    engine.submit("budget", [7, 8], replace(seeded, max_new_tokens=stop_at))
    engine.submit("context", [7] * 60 + [8], SamplingParams(max_new_tokens=50, seed=0))
    out = run(engine)
    assert out["eos"].token_ids == free[: stop_at + 1] and out["eos"].finish_reason == "stop"
    assert out["budget"].token_ids == free[:stop_at] and out["budget"].finish_reason == "length"
    assert len(out["context"].token_ids) == 3 and out["context"].finish_reason == "length"  # 61 + 3 = 64

    engine = Engine(model, max_batch_size=4, max_context=64, tokenizer=tokenizer)
    engine.submit("token", [7, 8], replace(seeded, stop_token_ids=(free[stop_at],)))
    target = tokenizer.decode(free[stop_at - 1 : stop_at + 1])
    engine.submit("string", [7, 8], replace(seeded, stop_strings=(target,)))
    out = run(engine)
    assert out["token"].token_ids == free[: stop_at + 1] and out["token"].finish_reason == "stop"
    first_hit = next(j for j in range(12) if target in tokenizer.decode(free[: j + 1]))
    assert out["string"].token_ids == free[: first_hit + 1] and out["string"].finish_reason == "stop"


def test_stop_strings_ignore_forced_text(model):
    tokenizer = build_char_tokenizer("abcdefghijk")
    engine = Engine(model, max_batch_size=2, max_context=64, tokenizer=tokenizer)
    engine.submit("t", [7, 8], SamplingParams(max_new_tokens=3, temperature=0.0))
    forced = append_forced_tokens(run(engine)["t"], tokenizer.encode("aaaa"))
    continued = SamplingParams(max_new_tokens=len(forced.token_ids) + 3, temperature=0.0)
    engine.submit("t", [7, 8], continued, prefix=forced)
    free = run(engine)["t"]
    assert "aaaa" not in tokenizer.decode(free.token_ids[len(forced.token_ids) :])  # precondition
    stopping = SamplingParams(max_new_tokens=continued.max_new_tokens, temperature=0.0, stop_strings=("aaaa",))
    engine.submit("t", [7, 8], stopping, prefix=forced)
    assert run(engine)["t"].token_ids == free.token_ids


def test_abort_returns_partials_and_the_rest_keep_decoding_correctly(model):
    engine = Engine(model, max_batch_size=3, max_context=64)
    submit_mix(engine, n=5)
    finished = {}
    for _ in range(6):
        finished.update((g.request_id, g) for g in engine.step())
    live = engine.num_running + engine.num_waiting
    partials = engine.abort(["r1", "r4", "unknown"])  # r1 is running, r4 still waiting
    assert [p.request_id for p in partials] == ["r1", "r4"]
    assert all(p.finish_reason == "abort" for p in partials)
    assert len(partials[0].token_ids) > 0 and partials[1].token_ids == ()
    assert engine.num_running + engine.num_waiting == live - 2
    out = {**finished, **run(engine)}
    assert set(out) == {"r0", "r2", "r3"}
    for g in out.values():
        recomputed, _ = token_logprobs(model, torch.tensor([g.prompt_ids + g.token_ids]), with_entropy=False)
        assert (recomputed[0, len(g.prompt_ids) :] - torch.tensor(g.behavior_logprobs)).abs().max() < 1e-5


def test_a_prefix_that_fills_the_budget_finishes_without_decoding(model):
    engine = Engine(model, max_batch_size=2, max_context=64)
    engine.submit("a", [1, 2], SamplingParams(max_new_tokens=3, seed=0))
    done = run(engine)["a"]
    engine.submit("a", [1, 2], done.params, prefix=done)
    again = engine.step()
    assert [g.token_ids for g in again] == [done.token_ids] and again[0].finish_reason == "length"


def test_bad_requests_raise_value_errors_that_name_the_problem(model):
    engine = Engine(model, max_batch_size=2, max_context=16)
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="max_context"):
        engine.submit("long", [1] * 16, params)
    with pytest.raises(ValueError, match="empty"):
        engine.submit("empty", [], params)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit("oov", [1, VOCAB], params)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.submit("stop", [1], SamplingParams(stop_strings=("ab",)))
    engine.submit("dup", [1], params)
    with pytest.raises(ValueError, match="unique"):
        engine.submit("dup", [1], params)
    with pytest.raises(ValueError, match="prompt_ids differ"):
        engine.submit("x", [2], params, prefix=engine.pause()[0])
    tokenizer = build_char_tokenizer("ab", special_tokens=("<pad>", "<eos>", "<unk>"))
    with pytest.raises(ValueError, match="cannot be produced"):
        Engine(model, max_batch_size=2, max_context=16, tokenizer=tokenizer).submit(
            "z", [1], SamplingParams(stop_strings=("az",))
        )
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1), dict(max_new_tokens=0), dict(seed=-3)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Engine(model, max_batch_size=2, max_context=129)


@pytest.mark.parametrize("architecture", ["llama-gqa", "gpt2", "qwen2-eager"])
def test_other_hugging_face_architectures(architecture):
    torch.manual_seed(0)
    config, attention = {
        "llama-gqa": (
            LlamaConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            ),
            "sdpa",
        ),
        "gpt2": (GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                            eos_token_id=0), "sdpa"),
        "qwen2-eager": (sharp_model().config, "eager"),
    }[architecture]
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    engine = Engine(model, max_batch_size=2, max_context=32, prefill_threshold=3, split_min_saving=0)
    submit_mix(engine, n=4)
    out = run(engine)
    # The model's own forward splits long and short rows; the fused step reads each row's own length, never split.
    assert (engine.stats.split_steps > 0) == (engine.fused_decode_off is not None)
    for g in out.values():
        recomputed, _ = token_logprobs(model, torch.tensor([g.prompt_ids + g.token_ids]), with_entropy=False)
        assert (recomputed[0, len(g.prompt_ids) :] - torch.tensor(g.behavior_logprobs)).abs().max() < 1e-5


def test_length_split_separates_a_long_tail_only_when_it_pays():
    assert length_split([100, 2, 3, 1], min_saving=0) == ([0], [1, 2, 3])
    assert length_split([5, 90, 4, 88, 6], min_saving=0) == ([1, 3], [0, 2, 4])
    # one forward over 4 x 101 row-positions vs 101 + 3 x 4: saves 291, under a floor of 300
    assert length_split([100, 2, 3, 1], min_saving=300) is None
    assert length_split([7, 7, 7], min_saving=0) is None  # nothing to spare
    assert length_split([9, 8, 7, 6], min_saving=0) is None  # spares less than a third of the reads
    assert length_split([3], min_saving=0) is None


@pytest.mark.parametrize("prefill_threshold", [0, 100])
def test_split_steps_give_the_tokens_and_logprobs_of_single_forward_steps(model, prefill_threshold):
    # A long request decodes among short ones that keep joining: most steps split when allowed to.
    def generate(split_min_saving):
        engine = Engine(model, max_batch_size=6, max_context=96, prefill_threshold=prefill_threshold,
                        split_min_saving=split_min_saving, fused_decode=False)  # (the fused step never splits)
        engine.submit("long", [3] * 30, SamplingParams(max_new_tokens=50, seed=9))
        for _ in range(25):
            engine.step()
        submit_mix(engine, n=9)
        return run(engine), engine.stats

    (split, split_stats), (whole, whole_stats) = generate(split_min_saving=0), generate(split_min_saving=10**9)
    assert whole_stats.split_steps == 0 and split_stats.split_steps > 10
    assert split.keys() == whole.keys() and len(split) == 10
    for request_id, g in split.items():
        assert g.token_ids == whole[request_id].token_ids, request_id
        recomputed, _ = token_logprobs(model, torch.tensor([g.prompt_ids + g.token_ids]), with_entropy=False)
        assert (recomputed[0, len(g.prompt_ids) :] - torch.tensor(g.behavior_logprobs)).abs().max() < 1e-5
