"""TurnRenderer: observations as forced tokens, against a real byte-level BPE tokenizer with a Qwen-style
ChatML template (the conftest `chat_tokenizer`), with regression tests for peers' multi-turn bugs:
verl #6501 (the `\\n` after `<|im_end|>`), slime #2263 (tool results merged into one user turn), AReaL #647
(a BPE merge across the sampled/observation boundary)."""

from __future__ import annotations

import copy

import pytest

from flashreinforce.envs.turns import TemplateNotAppendable, TurnRenderer, cut_text
from flashreinforce.models import build_char_tokenizer
from flashreinforce.types import Prompt

SYSTEM_AND_USER = ({"role": "system", "content": "You are a helpful assistant."},
                   {"role": "user", "content": "What is 2+3? Answer with a number."})
ANSWER = "The answer is 5."


def render_ids(tokenizer, messages, generation_prompt=True) -> list[int]:
    return list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt,
                                              tokenize=True, return_dict=True)["input_ids"])


def render_text(tokenizer, messages, generation_prompt=True) -> str:
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, tokenize=False)


def chat_start(tokenizer, renderer):
    """The first prompt of a chat episode (no reset observation) and its conversation."""
    ids, conversation = renderer.first_prompt(Prompt("p0", SYSTEM_AND_USER, "5"), "")
    assert ids == render_ids(tokenizer, SYSTEM_AND_USER)
    return ids, conversation


def count(ids, token_id) -> int:
    return sum(t == token_id for t in ids)


# ---- verl #6501: the separator after <|im_end|> ------------------------------------------------------------

def test_the_newline_after_im_end_is_forced_and_the_row_equals_the_full_conversation(chat_tokenizer):
    tok = chat_tokenizer
    renderer = TurnRenderer(tok)
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    newline = tok.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    prompt_ids, conversation = chat_start(tok, renderer)
    sampled = [*tok.encode(ANSWER, add_special_tokens=False), im_end]  # the turn ended on EOS

    forced, after = renderer.observation_ids(conversation, sampled, "ok")

    assert forced[0] == newline[0], "the template's \\n after <|im_end|> was dropped (verl #6501)"
    assert forced[1] == im_start
    assert tok.decode(forced[1:]).startswith("<|im_start|>user\nok<|im_end|>")
    assert count(forced, im_end) == 1  # the turn's own <|im_end|> is sampled, not forced again
    full = [*SYSTEM_AND_USER, {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "ok"}]
    assert after == tuple(full)
    # token for token, the row is what the template renders for the whole conversation
    assert [*prompt_ids, *sampled, *forced] == render_ids(tok, full)
    text = render_text(tok, full)
    assert tok.decode([*sampled, *forced]) == text[text.index(ANSWER):]


def test_the_second_observation_also_gets_its_separator(chat_tokenizer):
    tok = chat_tokenizer
    renderer = TurnRenderer(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt_ids, conversation = chat_start(tok, renderer)
    turn1 = [*tok.encode(ANSWER, add_special_tokens=False), im_end]
    forced1, conversation = renderer.observation_ids(conversation, turn1, "ok")
    turn2 = [*tok.encode("#### 42", add_special_tokens=False), im_end]
    forced2, conversation = renderer.observation_ids(conversation, turn2, "Let me think step by step.")
    row = [*prompt_ids, *turn1, *forced1, *turn2, *forced2]
    assert row == render_ids(tok, conversation)
    assert len(conversation) == 6


def test_a_turn_that_stopped_on_a_stop_string_gets_im_end_and_newline_forced(chat_tokenizer):
    tok = chat_tokenizer
    renderer = TurnRenderer(tok)
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    prompt_ids, conversation = chat_start(tok, renderer)
    sampled = tok.encode(ANSWER, add_special_tokens=False)  # stopped on a stop string: no <|im_end|> sampled
    assert im_end not in sampled

    forced, _ = renderer.observation_ids(conversation, sampled, "ok")

    assert forced[:3] == [im_end, *tok.encode("\n", add_special_tokens=False), im_start]
    full = [*SYSTEM_AND_USER, {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "ok"}]
    assert [*prompt_ids, *sampled, *forced] == render_ids(tok, full)


# ---- slime #2263: a step's tool results are one user turn -------------------------------------------------

def test_two_tool_results_of_one_step_render_as_one_user_turn(chat_tokenizer):
    tok = chat_tokenizer
    renderer = TurnRenderer(tok, role="tool")
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    prompt_ids, conversation = chat_start(tok, renderer)
    turn = [*tok.encode(ANSWER, add_special_tokens=False), im_end]
    results = [{"role": "tool", "content": "15"}, {"role": "tool", "content": "ok"}]

    forced, after = renderer.observation_ids(conversation, turn, results)

    text = tok.decode(forced)
    # one user turn for the step (plus the generation prompt's <|im_start|>assistant), both results inside it
    assert count(forced, im_start) == 2 and text.count("<|im_start|>user") == 1
    assert text.count("<tool_response>") == 2
    assert text.index("15") < text.index("ok") < text.index("<|im_end|>") < text.index("<|im_start|>assistant")
    assert [*prompt_ids, *turn, *forced] == render_ids(tok, after)

    # rendered as two successive steps (one result each, with a model turn between) there are two user turns
    first, conversation2 = renderer.observation_ids(conversation, turn, [results[0]])
    second, _ = renderer.observation_ids(conversation2, turn, [results[1]])
    separate = tok.decode([*first, *second])
    assert separate.count("<|im_start|>user") == 2
    assert separate.count("<tool_response>") == 2
    # and a single tool message as a plain string observation is the tool role too
    single, _ = renderer.observation_ids(conversation, turn, "15")
    assert tok.decode(single).count("<tool_response>") == 1


# ---- AReaL #647: no retokenization across the boundary ----------------------------------------------------

def merge_across_boundary(tok) -> tuple[str, str]:
    """A split a|b of a corpus word where BPE tokenizes a+b differently from a then b."""
    for word in ("Alla", "Allan", "Allah", "answer", "helpful", "assistant"):
        for cut in range(1, len(word)):
            a, b = word[:cut], word[cut:]
            if tok.encode(a + b, add_special_tokens=False) != (tok.encode(a, add_special_tokens=False)
                                                                + tok.encode(b, add_special_tokens=False)):
                return a, b
    raise AssertionError("no BPE merge across a split found")


def test_sampled_ids_are_kept_verbatim_across_a_bpe_merge_boundary(chat_tokenizer):
    tok = chat_tokenizer
    a, b = merge_across_boundary(tok)
    renderer = TurnRenderer(tok)
    prompt_ids, conversation = renderer.first_prompt(Prompt("p0", "Say a name: ", ""), "")
    assert conversation is None  # plain text: the observation continues the text directly
    sampled = tok.encode(a, add_special_tokens=False)
    forced, _ = renderer.observation_ids(conversation, sampled, b)
    row = [*prompt_ids, *sampled, *forced]

    assert row[len(prompt_ids):len(prompt_ids) + len(sampled)] == sampled
    assert forced == tok.encode(b + renderer.observation_suffix, add_special_tokens=False)
    assert renderer.action_text(sampled) == a
    # decoding the row and encoding it again merges a|b: the retokenized row is not what was sampled
    retokenized = tok.encode(tok.decode(row), add_special_tokens=False)
    assert tok.decode(retokenized) == tok.decode(row)
    assert retokenized != row


def test_a_non_canonical_sampled_turn_is_not_retokenized_in_chat_mode(chat_tokenizer):
    tok = chat_tokenizer
    a, b = merge_across_boundary(tok)
    renderer = TurnRenderer(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt_ids, conversation = chat_start(tok, renderer)
    # the model sampled a+b as two pieces, not as the tokenizer's canonical encoding of a+b
    sampled = [*tok.encode(a, add_special_tokens=False), *tok.encode(b, add_special_tokens=False), im_end]
    forced, after = renderer.observation_ids(conversation, sampled, "ok")
    row = [*prompt_ids, *sampled, *forced]
    assert row[len(prompt_ids):len(prompt_ids) + len(sampled)] == sampled
    assert after[-2] == {"role": "assistant", "content": a + b}
    assert render_ids(tok, after) != row  # the template's own tokenization of the same conversation differs
    assert tok.decode(render_ids(tok, after)) == tok.decode(row)


# ---- templates that rewrite earlier turns ------------------------------------------------------------------

QWEN3_LIKE_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "{%- set content = m['content'] %}"
    "{%- if loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif m['role'] == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen3-like: the <think> block of an assistant message before the last user message is dropped."""


@pytest.fixture
def qwen3_like_tokenizer(chat_tokenizer):
    tok = copy.deepcopy(chat_tokenizer)  # the fixture is session-wide: do not change its template
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    return tok


def test_a_template_that_strips_old_think_blocks_is_refused_with_the_reason_and_the_fix(qwen3_like_tokenizer):
    tok = qwen3_like_tokenizer
    thought = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nr\n</think>\n\na"}]
    assert "<think>" in render_text(tok, thought, False)
    assert "<think>" not in render_text(tok, [*thought, {"role": "user", "content": "o"}], False)  # rewritten

    with pytest.raises(TemplateNotAppendable) as caught:
        TurnRenderer(tok, role="user")
    message = str(caught.value)
    assert "renders earlier turns differently" in message and "'user'" in message  # why
    assert "<think>" in message and "retokeniz" in message
    assert "tokenizer.chat_template" in message and "env.role" in message  # what to do


def test_the_same_template_works_for_tool_observations(qwen3_like_tokenizer):
    tok = qwen3_like_tokenizer
    renderer = TurnRenderer(tok, role="tool")  # no error: a tool message does not move the last user message
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt_ids, conversation = renderer.first_prompt(Prompt("p0", ({"role": "user", "content": "q"},), ""), "")
    sampled = [*tok.encode("<think>\nr\n</think>\n\nprint(1)", add_special_tokens=False), im_end]
    forced, after = renderer.observation_ids(conversation, sampled, "1")
    assert [*prompt_ids, *sampled, *forced] == render_ids(tok, after)
    assert "<tool_response>\n1\n</tool_response>" in tok.decode(forced)


# ---- plain text -------------------------------------------------------------------------------------------

def test_plain_text_observations_are_encoded_alone_and_long_ones_are_cut(chat_tokenizer):
    tok = chat_tokenizer
    renderer = TurnRenderer(tok, max_observation_chars=20, observation_suffix="")
    _, conversation = renderer.first_prompt(Prompt("p0", "2+3=", "5"), "")
    assert conversation is None
    sampled = tok.encode("5", add_special_tokens=False)
    short = " Correct. Next: 4+4="
    forced, after = renderer.observation_ids(conversation, sampled, short)
    assert forced == tok.encode(short, add_special_tokens=False) and after is None

    long = "x" * 25 + " the rest of a long tool output"
    forced, _ = renderer.observation_ids(conversation, sampled, long)
    capped = long[:20] + f"\n[... {len(long) - 20} characters cut]"
    assert cut_text(long, 20) == capped
    assert forced == tok.encode(capped, add_special_tokens=False)
    assert tok.decode(forced).endswith(f"[... {len(long) - 20} characters cut]")
    assert "the rest" not in tok.decode(forced)


def test_plain_text_observations_end_with_the_observation_suffix(chat_tokenizer):
    tok = chat_tokenizer
    renderer = TurnRenderer(tok)
    assert renderer.observation_suffix == "\n"  # the default: the model's next turn starts on a new line
    forced, _ = renderer.observation_ids(None, tok.encode("5", add_special_tokens=False), " Correct.")
    assert forced == tok.encode(" Correct.\n", add_special_tokens=False)
    messages = [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]  # messages, in plain text
    forced, _ = renderer.observation_ids(None, [], messages)
    assert forced == tok.encode("a\nb\n", add_special_tokens=False)


def test_plain_text_mode_without_a_chat_template():
    tok = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 +=.\n")
    renderer = TurnRenderer(tok, max_observation_chars=5)
    ids, conversation = renderer.first_prompt(Prompt("p0", "2+3=", "5"), "ok. ")
    assert conversation is None and ids == tok.encode("2+3=\nok. \n", add_special_tokens=False)
    assert tok.unk_token_id not in ids
    sampled = [*tok.encode("5", add_special_tokens=False), tok.eos_token_id]
    assert renderer.action_text(sampled) == "5"
    forced, _ = renderer.observation_ids(None, sampled, " good")
    assert forced == tok.encode(" good\n", add_special_tokens=False)  # no end-of-turn token forced
    with pytest.raises(ValueError, match="no chat template"):
        renderer.first_prompt(Prompt("p1", ({"role": "user", "content": "hi"},), ""), "")


# ---- first prompts ----------------------------------------------------------------------------------------

def test_a_chat_prompts_reset_observation_is_appended_to_its_last_user_message(chat_tokenizer):
    tok = chat_tokenizer
    renderer = TurnRenderer(tok)
    ids, conversation = renderer.first_prompt(Prompt("p0", SYSTEM_AND_USER, "5"), "You are in a room.")
    expected = [SYSTEM_AND_USER[0], {"role": "user", "content": f"{SYSTEM_AND_USER[1]['content']}\n\nYou are in a room."}]
    assert conversation == tuple(expected)
    assert ids == render_ids(tok, expected)
    assert tok.decode(ids).count("<|im_start|>user") == 1
    assert SYSTEM_AND_USER[1]["content"] == "What is 2+3? Answer with a number."  # the prompt is not mutated

    # a prompt that does not end with a user message gets the observation as a new user message
    system_only = (SYSTEM_AND_USER[0],)
    ids, conversation = renderer.first_prompt(Prompt("p1", system_only, ""), "You are in a room.")
    assert conversation == (SYSTEM_AND_USER[0], {"role": "user", "content": "You are in a room."})
    assert ids == render_ids(tok, conversation)


def test_a_plain_prompts_reset_observation_is_concatenated(chat_tokenizer):
    tok = chat_tokenizer
    renderer = TurnRenderer(tok, max_observation_chars=8, observation_suffix="")
    ids, conversation = renderer.first_prompt(Prompt("p0", "Task: ", "5"), "You are in a room.")
    assert conversation is None
    assert ids == tok.encode("Task: \n" + cut_text("You are in a room.", 8), add_special_tokens=False)
    assert "characters cut]" in tok.decode(ids)
    # no reset observation: the prompt alone, nothing added
    assert renderer.first_prompt(Prompt("p1", "Task: ", "5"), "")[0] == tok.encode("Task: ", add_special_tokens=False)
