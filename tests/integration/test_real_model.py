"""A real model end to end: SmolLM2-135M-Instruct as `flashreinforce models get` converts it.

Skipped, naming the command, when the conversion is not in the cache ($FLASHREINFORCE_CACHE/models or
~/.cache/flashreinforce/models); CI runs `flashreinforce models get smollm2-135m-instruct` first.
About 20 s on this shared 2-core machine with OMP_NUM_THREADS=1 (over 2 minutes with 2 threads while another
job held one of the cores: the threads then wait on each other), hence slow.
"""

from __future__ import annotations

import copy
import unicodedata
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from flashreinforce.models import store, token_logprobs
from flashreinforce.rollout.engine import Engine
from flashreinforce.run.policy import load_policy
from flashreinforce.types import SamplingParams

pytestmark = pytest.mark.slow

NAME = "smollm2-135m-instruct"
IM_END = 2
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+3?"}],
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are a terse calculator."}, {"role": "user", "content": "12*7?"}],
    [{"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "Red, green and blue."},
     {"role": "user", "content": "And three more, please?"}],
    [{"role": "user", "content": "Explain in one sentence why the sky looks blue during the day but red and "
                                 "orange at sunset, for a curious ten-year-old who likes science."}],
    [{"role": "user", "content": "Übersetze: 'café', naïve — 東京 😀\n\tdef f(x):\n        return x  # ok"}],
]


@pytest.fixture(scope="module")
def model_dir():
    cached = store.find(NAME)
    if cached.problem is not None:
        pytest.skip(f"needs the converted model ({cached.path} {cached.problem}): run "
                    f"`flashreinforce models get {NAME}` first")
    return cached.path


@pytest.fixture(scope="module")
def policy(model_dir):
    return load_policy(model_dir)


def chat_text(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def chat_ids(tokenizer, messages) -> list[int]:
    return tokenizer(chat_text(tokenizer, messages), add_special_tokens=False)["input_ids"]


def run(engine) -> dict:
    out = {}
    while engine.has_work:
        out.update((g.request_id, g) for g in engine.step())
    return out


def test_transformers_loads_the_directory_with_every_weight_accounted_for(model_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}, info
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as published
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.generation_config.eos_token_id == IM_END
    assert model.generation_config.do_sample is None and model.generation_config.top_p is None


def test_the_tokenizer_ends_turns_with_im_end(policy):
    tokenizer = policy.tokenizer
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|im_end|>", IM_END, IM_END)
    text = chat_text(tokenizer, CONVERSATIONS[0])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_a_chat_prompt_round_trips_token_for_token(policy, messages):
    tokenizer = policy.tokenizer
    text = chat_text(tokenizer, messages)
    ids = chat_ids(tokenizer, messages)
    assert tokenizer.decode(ids) == text
    assert tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] == ids
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    templated = templated["input_ids"] if hasattr(templated, "keys") else templated
    assert list(templated) == ids
    assert ids.count(1) == text.count("<|im_start|>") and ids.count(IM_END) == text.count("<|im_end|>")


def test_numbers_split_into_one_token_per_digit(policy):
    """The GGUF names llama.cpp's "smollm" pre-tokenizer, which isolates every number character before BPE;
    transformers builds a plain byte-level one instead. They agree because no token of the vocabulary joins a
    number character to anything else."""
    tokenizer = policy.tokenizer
    joined = [token for token in tokenizer.get_vocab() if len(text := tokenizer.convert_tokens_to_string([token])) > 1
              and any(unicodedata.category(c).startswith("N") for c in text)]
    assert joined == []
    ids = tokenizer("In 2024, 1234567 + 89 = 1234656.", add_special_tokens=False)["input_ids"]
    digits = [t for t in tokenizer.convert_ids_to_tokens(ids) if any(c.isdigit() for c in t)]
    assert digits == list("20241234567891234656")


def test_greedy_generation_answers_a_chat_question(policy):
    tokenizer, model = policy.tokenizer, policy.model
    prompt = torch.tensor([chat_ids(tokenizer, CONVERSATIONS[0])])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)
    assert "5" in answer, answer
    assert out[0, -1].item() == IM_END, "the reply ends its turn"


def padded(rows: list[list[int]], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), IM_END)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(0, len(row)) if side == "right" else slice(width - len(row), width)
        ids[i, span], mask[i, span] = torch.tensor(row), 1
    return ids, mask


def test_behavior_logprobs_match_the_trainer_recompute_in_fp32(policy, capsys):
    """Six chat prompts (26 to 64 tokens) through 4 slots, sampled at T=1 with no truncation; the trainer's
    batched recompute, right- and left-padded, on an untouched copy of the same fp32 weights."""
    tokenizer = policy.tokenizer
    trainer_model = copy.deepcopy(policy.model).eval()
    engine = Engine(copy.deepcopy(policy.model), max_batch_size=4, max_context=256,
                    eos_token_ids=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer)
    for i, messages in enumerate(CONVERSATIONS):
        engine.submit(f"r{i}", chat_ids(tokenizer, messages),
                      SamplingParams(max_new_tokens=24, temperature=1.0, top_k=0, top_p=1.0, seed=i))
    out = run(engine)
    generations = [out[f"r{i}"] for i in range(len(CONVERSATIONS))]
    rows = [list(g.prompt_ids + g.token_ids) for g in generations]
    worst = 0.0
    for side in ("right", "left"):
        ids, mask = padded(rows, side)
        with torch.no_grad():
            recomputed, _ = token_logprobs(trainer_model, ids, mask, with_entropy=False)
        for i, g in enumerate(generations):
            start = len(g.prompt_ids) + (0 if side == "right" else ids.shape[1] - len(rows[i]))
            got = recomputed[i, start:start + len(g.token_ids)]
            worst = max(worst, (got - torch.tensor(g.behavior_logprobs)).abs().max().item())
    with capsys.disabled():
        print(f"\nbehavior vs recomputed log-probs, fp32, {sum(len(g.token_ids) for g in generations)} tokens: "
              f"max |diff| {worst:.2e}")
    assert worst < 1e-4
    assert engine.stats.sampled_tokens == sum(len(g.token_ids) for g in generations)
    assert all(g.finish_reason in ("stop", "length") for g in generations)


def test_im_end_and_a_stop_string_stop_a_generation(policy):
    tokenizer = policy.tokenizer
    engine = Engine(copy.deepcopy(policy.model), max_batch_size=4, max_context=256,
                    eos_token_ids=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer)
    prompt = chat_ids(tokenizer, CONVERSATIONS[0])
    engine.submit("eos", prompt, SamplingParams(max_new_tokens=48, temperature=0.0))
    engine.submit("stop", prompt, SamplingParams(max_new_tokens=48, temperature=0.0, stop_strings=(" =",)))
    out = run(engine)
    eos = out["eos"]
    assert eos.finish_reason == "stop" and eos.token_ids[-1] == IM_END and len(eos.token_ids) < 48
    assert IM_END not in eos.token_ids[:-1]
    stop = out["stop"]
    text = tokenizer.decode(stop.token_ids)
    assert stop.finish_reason == "stop" and text.endswith(" =") and IM_END not in stop.token_ids
    assert stop.token_ids == eos.token_ids[:len(stop.token_ids)], "greedy: the same reply, cut at the string"


def test_a_checkpoint_after_one_sgd_step_loads_back_and_generates(policy, tmp_path):
    tokenizer = policy.tokenizer
    model = copy.deepcopy(policy.model).train()
    before = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    ids = torch.tensor([chat_ids(tokenizer, CONVERSATIONS[0]) + tokenizer("2 + 3 = 5<|im_end|>")["input_ids"]])
    loss = -token_logprobs(model, ids, with_entropy=False)[0][:, 1:].mean()
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=1e-3).step()
    model.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}, info
    after = reloaded.model.layers[0].mlp.down_proj.weight
    assert torch.equal(after, model.model.layers[0].mlp.down_proj.weight) and not torch.equal(after, before)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    again = load_policy(tmp_path)  # the way a run would start from it
    prompt = torch.tensor([chat_ids(again.tokenizer, CONVERSATIONS[0])])
    with torch.no_grad():
        out = again.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    assert out.shape[1] > prompt.shape[1]
    assert again.tokenizer.decode(out[0, prompt.shape[1]:]).strip()


@pytest.mark.parametrize("role", ["user", "tool"])
def test_multi_turn_rows_equal_the_template_of_the_whole_conversation(policy, role):
    """An episode's row (prompt, sampled turn, forced observation) is token for token what SmolLM2's chat
    template renders for the whole conversation, so multi-turn episodes run on it unchanged."""
    from flashreinforce.envs.turns import TurnRenderer
    from flashreinforce.types import Prompt

    tokenizer = policy.tokenizer
    renderer = TurnRenderer(tokenizer, role=role)  # refuses a template it cannot append to
    prompt_ids, conversation = renderer.first_prompt(Prompt("p", [{"role": "user", "content": "Go north."}], ""),
                                                     "You see a door.")
    sampled = [*tokenizer.encode("I open the door.", add_special_tokens=False), IM_END]
    forced, after = renderer.observation_ids(conversation, sampled, "The door is locked.")
    whole = tokenizer.apply_chat_template(list(after), add_generation_prompt=True, tokenize=False)
    assert [*prompt_ids, *sampled, *forced] == tokenizer(whole, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("mode", ["separate", "unified"])
def test_a_bf16_trainer_steps_on_the_real_model_and_unified_agrees_with_its_engine(policy, mode, one_thread):
    """bf16 on both sides (fp32 masters): one optimizer step on engine rollouts; in unified mode the engine's
    behavior log-probs equal the trainer's recompute to float rounding."""
    from flashreinforce.envs.single_turn import to_trajectory
    from flashreinforce.models.numerics import Numerics
    from flashreinforce.trainer.trainer import OptimizerSettings, Trainer
    from flashreinforce.types import Prompt, RolloutKey, Verdict

    numerics = Numerics("bf16", unified=mode == "unified")
    tokenizer = policy.tokenizer
    trainer = Trainer(copy.deepcopy(policy.model), loss="flashreinforce", loss_options={},
                      optimizer=OptimizerSettings(lr=1e-5, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=0,
                                                  total_steps=2, min_lr_ratio=1.0, grad_clip=1.0),
                      microbatch_size=2, pad_token_id=tokenizer.pad_token_id, temperature=1.0, max_new_tokens=16,
                      numerics=numerics)
    engine = Engine(copy.deepcopy(policy.model), max_batch_size=4, max_context=128, eos_token_ids=IM_END,
                    pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer, numerics=numerics)
    engine.load_weights(trainer.weights(), version=0)
    for i, messages in enumerate(CONVERSATIONS[:2]):  # bf16 kernels on 2 cores are slow: 2 rows (one rewarded)
        engine.submit(str(i), chat_ids(tokenizer, messages), SamplingParams(max_new_tokens=8, seed=i))
    finished = []
    while engine.has_work:
        finished += engine.step()
    rows = [to_trajectory(RolloutKey(g.request_id, 0), Prompt(g.request_id, "x", "y"), i, g,
                          Verdict(float(i % 2), bool(i % 2))) for i, g in enumerate(finished)]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.step(rows)
    assert next(trainer.model.parameters()).dtype == (torch.float32 if mode == "unified" else torch.bfloat16)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert torch.isfinite(torch.tensor(metrics["loss/policy"]))
    if mode == "unified":
        assert metrics["mismatch/same_weights_abs_max"] < 1e-4
    else:
        assert metrics["mismatch/same_weights_abs_max"] > 1e-4  # bf16 kernels on each side: visibly apart
