"""The built-in instructions task (data.kind=instructions): its config section, its splits, the tiny model's
tokenizer and its warm-start demonstrations."""

import pytest

from flashreinforce.config import load_config
from flashreinforce.data.instructions import request_of
from flashreinforce.run.data import load_data
from flashreinforce.run.policy import tiny_tokenizer
from flashreinforce.run.tasks import TASKS
from flashreinforce.verifiers.ifeval import ifeval_verifier

SMALL = ["data.instructions.num_train=300", "data.instructions.num_eval=40"]


def test_the_recipe_loads_its_splits_and_demonstrations_in_the_tiny_tokenizer():
    config = load_config("instructions", SMALL)
    data = load_data(config)
    assert (len(data.train), len(data.eval)) == (300, 40)
    assert all(p.data_source == "instructions" and p.difficulty in (1.0, 2.0, 3.0) for p in data.train)
    tokenizer = tiny_tokenizer(config)
    examples = TASKS["instructions"].sft_examples(config, tokenizer, data.train)
    assert len(examples) == 300
    score, rewards = ifeval_verifier(), []
    for item, (prompt_ids, target_ids) in zip(data.train, examples):
        assert tokenizer.unk_token_id not in prompt_ids + target_ids
        assert tokenizer.decode(prompt_ids) == item.prompt and target_ids[-1] == tokenizer.eos_token_id
        rewards.append(score(tokenizer.decode(target_ids[:-1]), item.ground_truth, item).reward)
    # violation_rate 0.4: about 60% of the constraints met, some demonstrations perfect, some not
    assert 0.5 < sum(rewards) / len(rewards) < 0.7 and 1.0 in rewards and min(rewards) < 1.0


def test_the_violation_rate_is_the_sections_knob():
    config = load_config("instructions", [*SMALL, "data.instructions.violation_rate=0"])
    data = load_data(config)
    tokenizer = tiny_tokenizer(config)
    score = ifeval_verifier()
    for item, (_, target_ids) in zip(data.train, TASKS["instructions"].sft_examples(config, tokenizer, data.train)):
        assert score(tokenizer.decode(target_ids[:-1]), item.ground_truth, item).passed


def test_the_section_refuses_constraints_it_cannot_draw():
    with pytest.raises(ValueError, match=r"data.instructions.constraints=.*english_lowercase is not one"):
        load_config("instructions", ["data.instructions.constraints=[change_case:english_lowercase]"])


def test_a_prompt_states_what_its_ground_truth_holds():
    data = load_data(load_config("instructions", SMALL))
    for item in data.eval:
        request = request_of(item)
        assert item.prompt.startswith(f"Name {request.count} ") and len(request.constraints) == item.difficulty


def test_chat_prompts_are_one_user_message_of_the_same_request_and_need_a_chat_model():
    plain = load_data(load_config("instructions", SMALL)).eval
    config = load_config(None, ["model.path=some/chat-model", "data.kind=instructions", *SMALL,
                                "data.instructions.chat=true"])
    chat = load_data(config).eval
    assert [p.prompt for p in chat] == [({"role": "user", "content": p.prompt.rstrip("\n")},) for p in plain]
    assert [p.ground_truth for p in chat] == [p.ground_truth for p in plain]
    assert all(request_of(c) == request_of(p) for c, p in zip(chat, plain))
    with pytest.raises(ValueError, match="data.instructions.chat=true renders prompts with a chat model's template"):
        load_config("instructions", ["data.instructions.chat=true"])
