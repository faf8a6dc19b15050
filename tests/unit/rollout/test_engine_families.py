"""Every family the local engine serves, as a tiny model built from its transformers config: behavior log-probs
equal the trainer's recompute (fp32, <= 1e-5) before and after a pause, a weight push and a resume, with sliding
windows masked as the family's own forward masks them and MoE routes replayed where the family's router is
reachable. Families the engine cannot serve exactly, and attention implementations it cannot mask, are refused."""

import copy

import pytest
import torch
import transformers as tf
from model_families import (
    FAMILY_NAMES,
    MOE_FAMILIES,
    REPLAYED_FAMILIES,
    VOCAB,
    WINDOW,
    WINDOWED_FAMILIES,
    family_config,
    tiny_family_model,
)

from flashreinforce.envs.single_turn import to_trajectory
from flashreinforce.models import token_logprobs
from flashreinforce.models.families import attention_windows, engine_attention
from flashreinforce.models.vision import VisionConfig, build_vision_lm
from flashreinforce.rollout import Engine
from flashreinforce.trainer.trainer import OptimizerSettings, Trainer
from flashreinforce.types import Prompt, RolloutKey, SamplingParams, Verdict

OPTIMIZER = OptimizerSettings(lr=3e-2, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=0, total_steps=4,
                              min_lr_ratio=1.0, grad_clip=1.0)
PROMPT_LENGTHS = (2, 9, 4, 20, 3, 14)  # inline and prefilled prompts, most longer than the window
BUDGETS = (6, 30, 8, 30, 5, 30)


def engine_for(model, **kwargs) -> Engine:
    return Engine(copy.deepcopy(model), max_batch_size=3, max_context=64, eos_token_ids=1, prefill_threshold=6,
                  split_min_saving=0, **kwargs)


def submit_all(engine: Engine) -> None:
    generator = torch.Generator().manual_seed(1)
    for i, (length, budget) in enumerate(zip(PROMPT_LENGTHS, BUDGETS)):
        prompt = torch.randint(2, VOCAB, (length,), generator=generator).tolist()
        engine.submit(f"r{i}", prompt, SamplingParams(max_new_tokens=budget, seed=i))


def trajectories(generations):
    return [to_trajectory(RolloutKey(g.request_id, 0), Prompt(g.request_id, "x", "y"), i, g,
                          Verdict(reward=float(i % 2), passed=bool(i % 2))) for i, g in enumerate(generations)]


def gap(model, generations) -> float:
    """Largest |behavior - recomputed| over the rows' sampled tokens, one row at a time (no padding)."""
    worst = 0.0
    for g in generations:
        with torch.no_grad():
            recomputed, _ = token_logprobs(model, torch.tensor([g.prompt_ids + g.token_ids]), with_entropy=False)
        worst = max(worst, float((recomputed[0, len(g.prompt_ids):] - torch.tensor(g.behavior_logprobs)).abs().max()))
    return worst


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_behavior_logprobs_equal_the_trainers_recompute_through_pause_a_push_and_resume(name):
    model = tiny_family_model(name)
    trainer = Trainer(copy.deepcopy(model), loss="flashreinforce", loss_options={}, optimizer=OPTIMIZER,
                      microbatch_size=4, pad_token_id=0, temperature=1.0, max_new_tokens=30,
                      router_replay=name in REPLAYED_FAMILIES)
    engine = engine_for(model)
    engine.load_weights(trainer.weights(), version=0)
    submit_all(engine)
    finished = []
    while len(finished) < 2:  # the short requests finish; the long ones are mid-generation
        finished += engine.step()
    partials = engine.pause()
    # The model's own forward splits long and short rows; the fused step reads each row's own length, never split.
    assert (engine.stats.split_steps > 0) == (engine.fused_decode_off is not None)
    assert len(partials) == len(PROMPT_LENGTHS) - len(finished)
    assert any(p.token_ids for p in partials)  # some were mid-generation (others still reading or waiting)
    before = trainer.step(trajectories(finished))  # recomputes under version 0, then steps to version 1
    assert before["mismatch/same_weights_abs_max"] <= 1e-5
    assert before["mismatch/same_weights_tokens"] == before["batch/policy_tokens"]

    engine.load_weights(trainer.weights(), version=1)  # the push
    for partial in partials:
        engine.submit(partial.request_id, partial.prompt_ids, partial.params, prefix=partial)
    resumed = []
    while engine.has_work:
        resumed += engine.step()
    assert {1} <= {v for g in resumed for v in g.policy_versions} and not any(g.stale_context for g in resumed)
    after = trainer.step(trajectories(resumed))  # recomputes under version 1
    assert after["mismatch/same_weights_abs_max"] <= 1e-5
    assert 0 < after["mismatch/same_weights_tokens"] < after["batch/policy_tokens"]  # version 0's tokens left out
    pushed = gap(model, [g for g in resumed if g.policy_versions[-1] == 1])
    assert pushed > 1e-3, "the push should have changed the weights the resumed tokens were sampled by"
    if name in REPLAYED_FAMILIES:
        assert all(g.routes is not None for g in finished + resumed)
        assert before["mismatch/route_disagreement"] == after["mismatch/route_disagreement"] == 0.0
    else:
        assert all(g.routes is None for g in finished + resumed)


@pytest.mark.parametrize("name", WINDOWED_FAMILIES)
def test_the_window_is_what_makes_the_engine_exact(name):
    """The same weights attending to every earlier position give other log-probs on these rows, so the engine
    matches the trainer only because it masks the window as the family's forward does."""
    model = tiny_family_model(name)
    windows = attention_windows(model.config)
    assert windows.window == WINDOW and windows.sliding_layers
    engine = engine_for(model)
    submit_all(engine)
    done = []
    while engine.has_work:
        done += engine.step()
    assert gap(model, done) <= 1e-5
    unwindowed = tiny_family_model(name, sliding_window=64)  # as wide as the context: no window at all
    unwindowed.load_state_dict(model.state_dict())
    assert gap(unwindowed, done) > 1e-3


def test_windows_follow_the_family():
    assert attention_windows(family_config("mistral")).sliding_layers == {0, 1, 2, 3}
    assert not attention_windows(family_config("mistral")).per_layer_type
    assert attention_windows(family_config("qwen2")).sliding_layers == {2, 3}  # layers >= max_window_layers
    gemma2 = attention_windows(family_config("gemma2"))
    assert gemma2.sliding_layers == {0, 2} and gemma2.per_layer_type  # local, global, local, global
    assert attention_windows(family_config("mistral", sliding_window=None)).window is None
    # OLMoE's config may carry a window its forward never applies: neither does the engine.
    assert attention_windows(family_config("olmoe", sliding_window=WINDOW)).window is None
    with pytest.raises(ValueError, match="gemma3_text with use_bidirectional_attention"):
        attention_windows(family_config("gemma3_text", use_bidirectional_attention=True))
    chunked = family_config("qwen2")
    chunked.layer_types = ["full_attention", "chunked_attention"] * 2
    with pytest.raises(ValueError, match=r"qwen2: layer_types \['chunked_attention'\]"):
        attention_windows(chunked)


def test_a_family_the_engine_is_not_tested_on_is_refused_at_load_by_name():
    starcoder = tf.AutoModelForCausalLM.from_config(tf.Starcoder2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    with pytest.raises(ValueError, match=r"model family 'starcoder2' is not among .* gemma2, .* mixtral, .*rollout.engine=vllm"):
        engine_for(starcoder)
    llama4 = tf.AutoModelForCausalLM.from_config(tf.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64))
    with pytest.raises(ValueError, match="Llama 4 attends in chunks"):
        engine_for(llama4)


def test_a_sliding_window_inside_a_model_that_reads_images_is_refused():
    language_model = tiny_family_model("mistral")
    vision = build_vision_lm(language_model, VisionConfig(image_token_id=VOCAB - 1))
    with pytest.raises(ValueError, match="mistral with a sliding window inside a model that reads images"):
        engine_for(vision)


@pytest.mark.parametrize(("name", "implementation", "expected"), [
    ("llama", "flex_attention", "sdpa"), ("gemma2", "flex_attention", None), ("llama", "paged|eager", "eager")])
def test_flex_and_paged_attention_run_with_the_families_masked_attention(name, implementation, expected):
    """flex_attention and paged attention compute the same attention but cannot take the engine's per-request
    masks: the engine runs its copy with sdpa where the family has it (None: Gemma 2 has it in some transformers
    releases, not in others), else eager (and eager for paged eager), and its log-probs are that forward's."""
    model = tf.AutoModelForCausalLM.from_config(family_config(name), attn_implementation=implementation)
    expected = expected or ("sdpa" if model._supports_sdpa else "eager")
    engine = engine_for(model)
    assert engine.model.config._attn_implementation == expected
    submit_all(engine)
    done = []
    while engine.has_work:
        done += engine.step()
    reference = tf.AutoModelForCausalLM.from_config(family_config(name), attn_implementation=expected)
    reference.load_state_dict(model.state_dict())
    assert gap(reference, done) <= 1e-5


def test_flex_attention_inside_a_model_that_reads_images_is_refused_naming_what_to_set():
    language_model = tf.AutoModelForCausalLM.from_config(family_config("llama"), attn_implementation="flex_attention")
    with pytest.raises(TypeError, match=r"'flex_attention' cannot be switched on VisionLM: .*'sdpa'"):
        engine_for(build_vision_lm(language_model, VisionConfig(image_token_id=VOCAB - 1)))


def test_an_attention_implementation_the_engine_cannot_mask_is_refused_naming_what_to_set():
    def unmasked(module, query, key, value, attention_mask, **kwargs):
        raise AssertionError("never called: the engine refuses it first")

    tf.AttentionInterface.register("test_unmasked_attention", unmasked)
    model = tf.AutoModelForCausalLM.from_config(family_config("llama"), attn_implementation="test_unmasked_attention")
    with pytest.raises(ValueError, match=r"'test_unmasked_attention' .* attn_implementation='sdpa'"):
        engine_for(model)
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        engine_attention(model, model.config)


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_moe_families_route_as_their_table_says(name):
    engine = engine_for(tiny_family_model(name))
    engine.submit("a", [3, 4, 5], SamplingParams(max_new_tokens=4, seed=0))
    (generation,) = [g for _ in range(8) for g in engine.step()]
    assert (generation.routes is not None) == (name in REPLAYED_FAMILIES)
