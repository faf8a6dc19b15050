"""OpenAI chat messages to prompt ids with the model's chat template, and completions back to messages.

Rendering: the messages (tool calls' arguments as JSON objects, as Hugging Face templates expect) and the `tools`
go through the tokenizer's own chat template (or endpoint.chat_template). A template that renders the same with
and without `tools` cannot show the model its tools: such a request is refused (400), never sent without them.

Continuing a conversation token for token: when a request repeats an earlier call's messages and the answer the
endpoint gave, its prompt is that call's row (prompt + the sampled ids, never re-tokenized) followed by the
template's suffix for the new messages: the conversation rendered with and without them, the difference taken,
preceded by what the template writes after an assistant's end-of-turn token (envs/turns.py does the same for
environment observations). `suffix` says when the template cannot be extended that way.

Tool calls: the Hermes format (Qwen2.5, Qwen3, Hermes, and HERMES_TEMPLATE below): each call a JSON object
{"name": ..., "arguments": {...}} between <tool_call> and </tool_call>. A block that does not parse stays text.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

from flashreinforce.endpoint.openai_api import APIError, Message

TemplateMessage = dict[str, Any]

HERMES_TEMPLATE = (
    "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' %}"
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if system %}{{- system + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou can call these functions. Their signatures, one JSON object per line:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call one, write a JSON object with its name and arguments between tags:\\n"
    "<tool_call>\\n{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\\n</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- elif system %}{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- if loop.first and message['content'] %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- if not loop.last %}{{- '\\n' }}{%- endif %}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""A ChatML template that renders `tools` and tool calls in the Hermes format the endpoint parses, and merges
consecutive tool results into one user turn. For a ChatML model whose own template has no tool format (SmolLM2):
endpoint.chat_template=hermes."""

CHAT_TEMPLATES = {"hermes": HERMES_TEMPLATE}
"""Templates endpoint.chat_template names; any other value is a path to a Jinja file."""

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_tool", "description": "d",
                                                  "parameters": {"type": "object", "properties": {}}}}]


def template_messages(messages: Sequence[Message]) -> list[TemplateMessage]:
    """Request messages as a Hugging Face chat template reads them: text content, `developer` as `system`, tool
    calls' arguments as JSON objects (a string that is not JSON stays a string)."""
    rendered = []
    for message in messages:
        entry: TemplateMessage = {"role": "system" if message.role == "developer" else message.role,
                                  "content": message.text()}
        if message.tool_calls:
            entry["tool_calls"] = [{"id": call.id, "type": "function",
                                    "function": {"name": call.function.name,
                                                 "arguments": json_arguments(call.function.arguments)}}
                                   for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            entry["name"] = message.name
        rendered.append(entry)
    return rendered


def json_arguments(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def same_answer(sent: TemplateMessage, answered: TemplateMessage) -> bool:
    """Whether a request's assistant message is the answer the endpoint gave (content, and tool calls by name and
    arguments; ids and formatting of the JSON aside)."""
    def calls(message: TemplateMessage) -> list[tuple[str, str]]:
        return [(c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                for c in message.get("tool_calls") or ()]
    return (sent["role"] == "assistant" and (sent.get("content") or "") == (answered.get("content") or "")
            and calls(sent) == calls(answered))


class ChatRenderer:
    """Renders requests with one tokenizer's chat template (or `template`), and reads completions back."""

    def __init__(self, tokenizer: Any, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template or tokenizer.chat_template
        self._drop_ids = {i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None}
        self.renders_tools: bool | None = None
        """Whether the template shows `tools` (checked at the first request with tools)."""
        self.close_id: int | None = None
        self.separator: list[int] = []
        if self.template:
            self.close_id, self.separator = self._turn_ending()

    def render(self, messages: Sequence[TemplateMessage], tools: list[dict[str, Any]] | None, *,
               generation_prompt: bool) -> list[int]:
        """Prompt ids; a template that fails on these messages or tools is the request's 400."""
        if not self.template:
            raise APIError(400, "the model's tokenizer has no chat template: use /v1/completions, or set "
                           "endpoint.chat_template (hermes: ChatML with tools)", code="no_chat_template")
        try:
            ids = self.tokenizer.apply_chat_template(list(messages), tools=tools, chat_template=self.template,
                                                     add_generation_prompt=generation_prompt, tokenize=True,
                                                     return_dict=True)["input_ids"]
        except Exception as error:  # noqa: BLE001 - Jinja raises anything on input it cannot render
            raise APIError(400, f"the chat template cannot render these messages or tools: "
                           f"{type(error).__name__}: {error}", code="template_error") from None
        return list(ids)

    def check_tools(self, tools: list[dict[str, Any]] | None) -> None:
        """A template that ignores `tools` would hide them from the model: refuse such a request."""
        if not tools:
            return
        if self.renders_tools is None:
            probe = [{"role": "user", "content": "hi"}]
            self.renders_tools = (self.render(probe, _PROBE_TOOLS, generation_prompt=True)
                                  != self.render(probe, None, generation_prompt=True))
        if not self.renders_tools:
            raise APIError(400, "the model's chat template does not render `tools`, so the model would never see "
                           "them: set endpoint.chat_template=hermes (ChatML with the Hermes tool format the endpoint "
                           "parses) or a template file that renders them", param="tools", code="tools_not_supported")

    def _turn_ending(self) -> tuple[int | None, list[int]]:
        """The end-of-turn token the template closes an assistant message with, and what follows it."""
        probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        try:
            ids = self.render(probe, None, generation_prompt=False)
        except APIError as error:  # at start: the run's template, not a request, is at fault
            raise ValueError(f"the chat template (endpoint.chat_template, or the tokenizer's) cannot render a user "
                             f"and an assistant message: {error.message}") from None
        ends = [j for j, t in enumerate(ids) if t in self._drop_ids]
        if not ends:
            return self.tokenizer.eos_token_id, []
        return ids[ends[-1]], ids[ends[-1] + 1:]

    def suffix(self, history: Sequence[TemplateMessage], new: Sequence[TemplateMessage],
               tools: list[dict[str, Any]] | None, turn_ids: Sequence[int]) -> list[int] | None:
        """Ids that follow an assistant turn `turn_ids` (the last of `history`, as sampled) for the `new` messages
        and the generation prompt; None when the template renders `history` differently once they are appended
        (then the request is rendered whole and opens a new segment)."""
        base = self.render(history, tools, generation_prompt=False)
        extended = self.render([*history, *new], tools, generation_prompt=True)
        if extended[: len(base)] != base:
            return None
        closing = [] if (turn_ids and turn_ids[-1] in self._drop_ids) or self.close_id is None else [self.close_id]
        return [*closing, *self.separator, *extended[len(base):]]

    def written_turn(self, messages: Sequence[TemplateMessage], answer: TemplateMessage,
                     tools: list[dict[str, Any]] | None) -> list[int]:
        """The ids the template writes for the assistant message `answer` after `messages` and the generation
        prompt, through its end-of-turn token: what a model that answered so would have sampled (a demonstration's
        turn; tool calls in the template's own format)."""
        prompt = self.render(messages, tools, generation_prompt=True)
        whole = self.render([*messages, answer], tools, generation_prompt=False)
        turn = whole[len(prompt):]
        if whole[: len(prompt)] != prompt or self.close_id not in turn:
            raise ValueError("the chat template does not write an assistant message as the continuation of its "
                             "generation prompt, ended by its end-of-turn token: a demonstration cannot be "
                             "rendered as sampled tokens with it")
        return turn[: turn.index(self.close_id) + 1]

    def answer(self, turn_ids: Sequence[int], stop_strings: Sequence[str], call_name: str,
               parse_tools: bool) -> tuple[TemplateMessage, str]:
        """The assistant message for a sampled turn, and its finish reason if it stopped (tool_calls or stop).
        The text ends before a stop string, as OpenAI's does; tool calls are parsed when the request had tools."""
        text = self.text(turn_ids, stop_strings)
        calls: list[dict[str, Any]] = []
        if parse_tools:
            text, calls = parse_tool_calls(text, call_name)
        message: TemplateMessage = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return message, "tool_calls" if calls else "stop"

    def text(self, turn_ids: Sequence[int], stop_strings: Sequence[str]) -> str:
        text = self.tokenizer.decode([t for t in turn_ids if t not in self._drop_ids], skip_special_tokens=False)
        for stop in stop_strings:
            if stop in text:
                text = text[: text.index(stop)]
        return text

    def pieces(self, turn_ids: Sequence[int]) -> list[str]:
        """Each sampled token's text (logprobs' `token` fields)."""
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in turn_ids]


def openai_message(message: TemplateMessage) -> dict[str, Any]:
    """An assistant message as the OpenAI API returns it: tool calls' arguments as JSON text."""
    calls = [{**call, "function": {"name": call["function"]["name"],
                                   "arguments": call["function"]["arguments"]
                                   if isinstance(call["function"]["arguments"], str)
                                   else json.dumps(call["function"]["arguments"])}}
             for call in message.get("tool_calls") or ()]
    return {"role": "assistant", "content": message["content"], **({"tool_calls": calls} if calls else {})}


def parse_tool_calls(text: str, call_name: str) -> tuple[str, list[dict[str, Any]]]:
    """(the text outside the tool calls, the tool calls, arguments as JSON objects as a chat template reads them)
    from a Hermes-format completion. A block whose
    JSON does not parse, or lacks a string name, stays in the text. Ids derive from `call_name`, so that a
    replayed episode sees the same ids."""
    calls, kept, at = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        try:
            value = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not (isinstance(value, dict) and isinstance(value.get("name"), str)
                and isinstance(value.get("arguments", {}), (dict, str))):
            continue
        arguments = value.get("arguments", {})
        digest = hashlib.blake2b(f"{call_name}/{len(calls)}".encode(), digest_size=12).hexdigest()
        calls.append({"id": f"call_{digest}", "type": "function",
                      "function": {"name": value["name"], "arguments": json_arguments(arguments)}})
        kept.append(text[at: match.start()])
        at = match.end()
    kept.append(text[at:])
    return "".join(kept).strip() if calls else text, calls
