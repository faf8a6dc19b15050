"""The tool task's data: plain `a*b=` prompts for the tiny model, chat questions for a chat model (the
`smollm2_tool` recipe), warm-start traces whose tool output is a chat `tool` message, and demonstrated answers to
an agent's calls (the `smollm2_agent` recipe)."""

import random

import pytest

from flashreinforce.config import load_config
from flashreinforce.data.tool_multiply import (
    code_parameter,
    demonstrate,
    episode_plan,
    make_tool_multiply_splits,
    operands,
    tool_trace,
)
from flashreinforce.run import tasks
from flashreinforce.types import Prompt
from flashreinforce.verifiers.registry import build_verifier


def test_chat_prompts_ask_the_same_problems_as_plain_ones():
    plain_train, plain_eval = make_tool_multiply_splits(50, 10, seed=3)
    chat_train, chat_eval = make_tool_multiply_splits(50, 10, seed=3, chat=True)
    for plain, chat in zip([*plain_train, *plain_eval], [*chat_train, *chat_eval]):
        assert (chat.id, chat.ground_truth) == (plain.id, plain.ground_truth)
        (message,) = chat.prompt
        assert message["role"] == "user" and "<code>" in message["content"] and "answer: " in message["content"]
        assert operands(chat) == operands(plain)
        a, b = operands(chat)
        assert a * b == int(chat.ground_truth) and f"{a}*{b}" in message["content"]


def test_operands_read_either_prompt_form():
    assert operands(Prompt("p", "123*45=", "5535")) == (123, 45)
    assert operands(Prompt("p", ({"role": "user", "content": "What is 123*45? Use the tool."},), "5535")) == (123, 45)


def test_a_chat_trace_shows_the_tool_output_as_a_tool_message_and_trains_only_the_model_turns(chat_tokenizer):
    config = load_config("smollm2_tool", ["sft.tool_rate=1.0", "sft.wrong_code_rate=0.0"])
    item = make_tool_multiply_splits(1, 1, seed=0, chat=True)[0][0]
    a, b = operands(item)
    first_turn = tool_trace(item, random.Random(0), tool_rate=1.0, wrong_code_rate=0.0)[0]
    assert first_turn.action == f"<code>print({a}*{b})</code>"
    prompt_ids, completion, mask = tasks._tool_multiply_examples(config, chat_tokenizer, [item])[0]
    assert chat_tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\n")
    # The row is the template's own rendering of the conversation with a `tool` message (this Qwen-style template
    # wraps it in a user turn's <tool_response>).
    conversation = [*item.prompt, {"role": "assistant", "content": f"<code>print({a}*{b})</code>"},
                    {"role": "tool", "content": f"<output>{a * b}</output>"},
                    {"role": "assistant", "content": f"answer: {a * b}"}]
    rendered = chat_tokenizer.apply_chat_template(conversation, tokenize=False)
    assert chat_tokenizer.decode(prompt_ids + completion) == rendered.rstrip("\n")
    trained = chat_tokenizer.decode([token for token, keep in zip(completion, mask) if keep])
    assert trained == f"<code>print({a}*{b})</code>answer: {a * b}<|im_end|>"


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_the_tool_rate_decides_which_traces_call_the_tool(rate):
    items = make_tool_multiply_splits(40, 1, seed=1, chat=True)[0]
    rng = random.Random(0)
    calls = [len(tool_trace(item, rng, tool_rate=rate, wrong_code_rate=0.0)) == 2 for item in items]
    assert all(calls) if rate == 1.0 else not any(calls)


def test_the_smollm2_tool_recipe_scores_only_a_stated_answer():
    """The chat question asks for 'answer: N'; a final turn that only prints the product in code is no answer
    (a run scored by the lenient math verifier learned to end every episode that way)."""
    verify = build_verifier(load_config("smollm2_tool").verifier.reward_fn)
    item = make_tool_multiply_splits(1, 1, seed=0, chat=True)[0][0]
    a, b = operands(item)
    assert verify(f"answer: {a * b}", item.ground_truth, item).passed
    verdict = verify(f"<code>print({a * b})</code>", item.ground_truth, item)
    assert (verdict.passed, verdict.reason) == (False, "no_answer")


PYTHON_TOOL = {"type": "function", "function": {"name": "python", "parameters": {
    "type": "object", "properties": {"timeout": {"type": "integer"}, "code": {"type": "string"}},
    "required": ["code"]}}}


def test_a_demonstration_calls_the_tool_that_takes_code_then_answers_what_it_printed():
    item = make_tool_multiply_splits(1, 1, seed=0)[0][0]
    a, b = operands(item)
    question = [{"role": "user", "content": f"What is {a}*{b}?"}]
    call = demonstrate(item, question, [PYTHON_TOOL], random.Random(0), tool_rate=1.0, wrong_code_rate=0.0)
    assert call["content"] is None
    (tool_call,) = call["tool_calls"]
    assert tool_call["function"] == {"name": "python", "arguments": {"code": f"print({a}*{b})"}}
    after = [*question, call, {"role": "tool", "tool_call_id": tool_call["id"], "content": f"{a * b}\n"}]
    answer = demonstrate(item, after, [PYTHON_TOOL], random.Random(0), tool_rate=1.0, wrong_code_rate=0.0)
    assert answer == {"role": "assistant", "content": f"answer: {a * b}"}


def test_demonstrations_follow_the_same_plans_as_the_tool_environments_traces():
    """The agent's warm start mixes tool calls, wrong code and mental guesses as the built-in tool task's does: the
    same draws from the same generator."""
    items = make_tool_multiply_splits(60, 1, seed=2)[0]
    for k, item in enumerate(items):
        plan = episode_plan(item, random.Random(k), tool_rate=0.4, wrong_code_rate=0.5)
        trace = tool_trace(item, random.Random(k), tool_rate=0.4, wrong_code_rate=0.5)
        message = demonstrate(item, [], [PYTHON_TOOL], random.Random(k), tool_rate=0.4, wrong_code_rate=0.5)
        assert trace[-1].action == f"answer: {plan.answer}"
        if plan.code is None:
            assert len(trace) == 1 and message["content"] == f"answer: {plan.answer}"
        else:
            assert trace[0].action == f"<code>{plan.code}</code>"
            assert message["tool_calls"][0]["function"]["arguments"] == {"code": plan.code}
    assert {episode_plan(i, random.Random(k), tool_rate=0.4, wrong_code_rate=0.5).code is None
            for k, i in enumerate(items)} == {True, False}


def test_the_code_goes_in_the_first_string_parameter_and_an_agent_without_one_is_told_why():
    assert code_parameter([PYTHON_TOOL]) == ("python", "code")
    numbers = {"type": "function", "function": {"name": "multiply", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    assert code_parameter([numbers]) is None and code_parameter([numbers, PYTHON_TOOL]) == ("python", "code")
    item = make_tool_multiply_splits(1, 1, seed=0)[0][0]
    with pytest.raises(ValueError, match=r"no tool with a string parameter \(its tools: \['multiply'\]\)"):
        demonstrate(item, [], [numbers], random.Random(0), tool_rate=1.0, wrong_code_rate=0.0)
    guess = demonstrate(item, [], [numbers], random.Random(0), tool_rate=0.0, wrong_code_rate=0.0)
    assert guess["content"].startswith("answer: ")
