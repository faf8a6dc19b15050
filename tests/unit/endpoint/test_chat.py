"""chat.py: requests rendered with the chat template (tools included), conversations continued token for token,
and completions read back into messages and Hermes tool calls. Against the conftest's byte-level BPE tokenizer with
a Qwen-style ChatML template, and the shipped HERMES_TEMPLATE."""

import json

import pytest

from flashreinforce.endpoint.chat import (
    HERMES_TEMPLATE,
    ChatRenderer,
    openai_message,
    parse_tool_calls,
    same_answer,
    template_messages,
)
from flashreinforce.endpoint.openai_api import APIError, Message

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]


def messages(*raw: dict) -> list[dict]:
    return template_messages([Message.model_validate(m) for m in raw])


def test_hermes_tool_calls_are_parsed_and_their_text_kept_apart():
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool_call>')
    content, calls = parse_tool_calls(text, "ep#0@1")
    assert content == "Let me add."
    assert [c["function"]["name"] for c in calls] == ["add", "add"]
    assert calls[0]["function"]["arguments"] == {"a": 2} and calls[1]["function"]["arguments"] == {"a": 3}
    assert calls[0]["id"] != calls[1]["id"]
    assert parse_tool_calls(text, "ep#0@1")[1][0]["id"] == calls[0]["id"], "ids must be the same on a replay"
    message = openai_message({"role": "assistant", "content": content, "tool_calls": calls})
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 2}


@pytest.mark.parametrize("block", ['<tool_call>{"name": "add", "arguments": {"a": </tool_call>',  # cut JSON
                                   '<tool_call>["add"]</tool_call>',                               # not an object
                                   '<tool_call>{"arguments": {}}</tool_call>',                     # no name
                                   '<tool_call>{"name": "add", "arguments": {"a": 1}}'])           # never closed
def test_a_block_that_does_not_parse_stays_text(block):
    assert parse_tool_calls(f"hi {block}", "x") == (f"hi {block}", [])


def test_the_answer_given_is_recognised_whatever_the_client_does_to_ids_and_json():
    _, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 1}}</tool_call>', "x")
    answered = {"role": "assistant", "content": None, "tool_calls": calls}
    sent = messages({"role": "assistant", "content": None, "tool_calls": [
        {"id": "other-id", "type": "function", "function": {"name": "add", "arguments": '{"b":1, "a":2}'}}]})[0]
    assert same_answer(sent, answered)
    changed = messages({"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 1}'}}]})[0]
    assert not same_answer(changed, answered)


def test_a_template_without_a_tool_format_is_refused_rather_than_hiding_the_tools(chat_tokenizer):
    renderer = ChatRenderer(chat_tokenizer)  # the Qwen-style test template renders no tools
    with pytest.raises(APIError) as refused:
        renderer.check_tools(TOOLS)
    assert refused.value.status == 400 and refused.value.code == "tools_not_supported"
    assert "endpoint.chat_template=hermes" in refused.value.message
    ChatRenderer(chat_tokenizer, HERMES_TEMPLATE).check_tools(TOOLS)  # the shipped one renders them


def test_the_hermes_template_shows_the_tools_and_renders_tool_calls_as_the_parser_reads_them(chat_tokenizer):
    renderer = ChatRenderer(chat_tokenizer, HERMES_TEMPLATE)
    _, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>', "x")
    conversation = [*messages({"role": "user", "content": "2+3?"}),
                    {"role": "assistant", "content": "", "tool_calls": calls}]
    text = chat_tokenizer.decode(renderer.render(conversation, TOOLS, generation_prompt=False))
    assert '"name": "add"' in text and "<tools>" in text
    assistant = text[text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"): text.rindex("<|im_end|>")]
    assert parse_tool_calls(assistant, "x")[1] == calls


def test_a_continued_conversation_is_the_row_and_the_suffix_and_equals_the_direct_render(chat_tokenizer):
    tok = chat_tokenizer
    renderer = ChatRenderer(tok, HERMES_TEMPLATE)
    first = messages({"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "What is 2+3? Answer with a number."})
    prompt = renderer.render(first, TOOLS, generation_prompt=True)
    sampled = [*tok.encode("The answer is 5.", add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
    answer, finish = renderer.answer(sampled, (), "x", parse_tools=True)
    assert answer == {"role": "assistant", "content": "The answer is 5."} and finish == "stop"
    history = [*first, answer]
    new = messages({"role": "tool", "content": "ok", "tool_call_id": "c1"})

    suffix = renderer.suffix(history, new, TOOLS, sampled)

    assert [*prompt, *sampled, *suffix] == renderer.render([*history, *new], TOOLS, generation_prompt=True)


def test_a_written_turn_is_what_the_template_renders_for_the_message_and_parses_back_to_it(chat_tokenizer):
    """A demonstration's turn as sampled ids: the template's own rendering of the assistant message after the
    generation prompt, through its end-of-turn token; the endpoint reads the same tool call back from it."""
    tok = chat_tokenizer
    renderer = ChatRenderer(tok, HERMES_TEMPLATE)
    history = messages({"role": "user", "content": "What is 2+3?"})
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]}

    turn = renderer.written_turn(history, call, TOOLS)

    prompt = renderer.render(history, TOOLS, generation_prompt=True)
    whole = renderer.render([*history, call], TOOLS, generation_prompt=False)
    assert [*prompt, *turn] == whole[: len(prompt) + len(turn)] and turn[-1] == renderer.close_id
    assert turn.count(renderer.close_id) == 1
    answer, finish = renderer.answer(turn, (), "x", parse_tools=True)
    assert finish == "tool_calls" and same_answer(call, answer)
    plain = renderer.written_turn(history, {"role": "assistant", "content": "answer: 5"}, TOOLS)
    assert tok.decode(plain) == "answer: 5<|im_end|>"


def test_a_template_that_does_not_continue_its_generation_prompt_cannot_write_a_turn(chat_tokenizer):
    odd = ("{%- for m in messages %}{{ m['role'] + ': ' + (m['content'] or '') + '<|im_end|>' }}{%- endfor %}"
           "{%- if add_generation_prompt %}{{ 'reply now: ' }}{%- endif %}")
    renderer = ChatRenderer(chat_tokenizer, odd)
    with pytest.raises(ValueError, match="cannot be rendered as sampled tokens"):
        renderer.written_turn(messages({"role": "user", "content": "hi"}), {"role": "assistant", "content": "yo"},
                              None)


def test_a_turn_cut_by_its_budget_gets_its_end_of_turn_forced(chat_tokenizer):
    tok = chat_tokenizer
    renderer = ChatRenderer(tok)
    first = messages({"role": "user", "content": "What is 2+3? Answer with a number."})
    sampled = tok.encode("The answer", add_special_tokens=False)  # no <|im_end|>: max_tokens ended it
    suffix = renderer.suffix([*first, {"role": "assistant", "content": "The answer"}],
                             messages({"role": "user", "content": "ok"}), None, sampled)
    assert suffix[0] == tok.convert_tokens_to_ids("<|im_end|>")


def test_stop_strings_end_the_returned_text_as_openai_does(chat_tokenizer):
    renderer = ChatRenderer(chat_tokenizer)
    sampled = chat_tokenizer.encode("The answer is 5. Let me", add_special_tokens=False)
    assert renderer.text(sampled, [" Let"]) == "The answer is 5."


def test_a_template_error_and_non_text_content_are_the_requests_400(chat_tokenizer):
    picky = ChatRenderer(chat_tokenizer, "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}"
                                         + chat_tokenizer.chat_template)
    with pytest.raises(APIError) as error:
        picky.render(messages({"role": "user", "content": "hi"}), TOOLS, generation_prompt=True)
    assert error.value.status == 400 and "no tools here" in error.value.message
    with pytest.raises(ValueError, match="cannot render a user and an assistant message"):
        ChatRenderer(chat_tokenizer, "{{ raise_exception('never') }}")
    with pytest.raises(APIError, match="image_url"):
        messages({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]})
