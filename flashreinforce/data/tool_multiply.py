"""The tool task: multi-digit multiplication, where one Python call makes the answer easy and mental
arithmetic (a small model's) does not.

A prompt is `a*b=` (or, for a chat model, a user message asking for a*b and saying how to call the tool); a good
episode writes `<code>print(a*b)</code>`, reads `<output>N</output>` and answers `answer: N`. Warm-start traces mix
tool episodes, mental answers (right for small products, with a digit off for large ones, as a model's guesses
are) and wrong code (`a+b`), so RL has a policy to fix. An agent of its own (env.kind=agent) gets the same mix as
demonstrated answers to its calls (`demonstrate`): a call of its code tool, or the guess, then the tool's output.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flashreinforce.types import Prompt

DATA_SOURCE = "tool_multiply"
CODE_OPEN, CODE_CLOSE, OUT_OPEN, OUT_CLOSE = "<code>", "</code>", "<output>", "</output>"
SPECIAL_TOKENS = (CODE_OPEN, CODE_CLOSE, OUT_OPEN, OUT_CLOSE)
ALPHABET = "0123456789*+=: \nanswerpit()"
"""Every character a prompt, a trace or an observation uses, besides the special tokens."""


@dataclass(frozen=True)
class TraceTurn:
    action: str
    """The model's turn as written (ends with </code> when it calls the tool)."""
    observation: str | None
    """What came back (None after the final answer)."""


def chat_question(a: int, b: int) -> str:
    """The user message of a chat prompt: the product asked for, and the tool's contract (a chat model has
    never seen these tags)."""
    return (f"What is {a}*{b}? You can run Python: write code between {CODE_OPEN} and {CODE_CLOSE} and you will "
            f"see what it prints. End with 'answer: ' and the number.")


def make_tool_multiply_splits(num_train: int, num_eval: int, *, seed: int, digits: tuple[int, int] = (3, 3),
                              chat: bool = False) -> tuple[list[Prompt], list[Prompt]]:
    """Disjoint train and held-out problems a*b with up to `digits` digits each (at least 2). `chat`: each
    prompt is one user message (chat_question), for a chat model's template."""
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()

    def draw(split: str, n: int) -> list[Prompt]:
        items = []
        while len(items) < n:
            a = rng.randint(10, 10 ** digits[0] - 1)
            b = rng.randint(10, 10 ** digits[1] - 1)
            if (a, b) in seen:
                continue
            seen.add((a, b))
            text = ({"role": "user", "content": chat_question(a, b)},) if chat else f"{a}*{b}="
            items.append(Prompt(id=f"{DATA_SOURCE}/{split}/{len(items):06d}", prompt=text,
                                ground_truth=str(a * b), data_source=DATA_SOURCE,
                                difficulty=float(len(str(a)) + len(str(b)))))
        return items

    held_out = draw("eval", num_eval)
    return draw("train", num_train), held_out


_PRODUCT = re.compile(r"(\d+)\*(\d+)")


def operands(prompt: Prompt) -> tuple[int, int]:
    """a and b of `a*b=` or of a chat question."""
    text = prompt.prompt if isinstance(prompt.prompt, str) else prompt.prompt[-1]["content"]
    a, b = _PRODUCT.search(text).groups()
    return int(a), int(b)


def mental_guess(a: int, b: int, rng: random.Random) -> int:
    """A small model's mental product: exact below 1000, else one digit off."""
    product = a * b
    if product < 1000:
        return product
    digits = list(str(product))
    j = rng.randrange(1, len(digits))
    digits[j] = str((int(digits[j]) + rng.randint(1, 9)) % 10)
    return int("".join(digits))


@dataclass(frozen=True)
class Plan:
    """What a warm-start episode does: run `code` and answer its output, or (code None) answer a mental guess."""

    code: str | None
    answer: int


def episode_plan(prompt: Prompt, rng: random.Random, *, tool_rate: float, wrong_code_rate: float) -> Plan:
    """The tool with probability tool_rate (wrong code, a+b, with wrong_code_rate), else a mental answer."""
    a, b = operands(prompt)
    if rng.random() >= tool_rate:
        return Plan(None, mental_guess(a, b, rng))
    wrong = rng.random() < wrong_code_rate
    return Plan(f"print({a}+{b})" if wrong else f"print({a}*{b})", a + b if wrong else a * b)


def tool_trace(prompt: Prompt, rng: random.Random, *, tool_rate: float, wrong_code_rate: float) -> list[TraceTurn]:
    """One warm-start episode of the built-in tool environment (episode_plan), in its tags."""
    plan = episode_plan(prompt, rng, tool_rate=tool_rate, wrong_code_rate=wrong_code_rate)
    if plan.code is None:
        return [TraceTurn(f"answer: {plan.answer}", None)]
    return [TraceTurn(f"{CODE_OPEN}{plan.code}{CODE_CLOSE}", f"{OUT_OPEN}{plan.answer}{OUT_CLOSE}"),
            TraceTurn(f"answer: {plan.answer}", None)]


def code_parameter(tools: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
    """(function name, parameter name) of the first tool that takes a string (its first required one, else its
    first): where a demonstration writes its code. None: no tool takes one."""
    for tool in tools:
        function = tool.get("function") or {}
        parameters = function.get("parameters") or {}
        strings = [name for name, schema in (parameters.get("properties") or {}).items()
                   if isinstance(schema, Mapping) and schema.get("type") == "string"]
        required = [name for name in parameters.get("required") or () if name in strings]
        if strings and isinstance(function.get("name"), str):
            return function["name"], (required or strings)[0]
    return None


def demonstrate(prompt: Prompt, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
                rng: random.Random, *, tool_rate: float, wrong_code_rate: float) -> dict[str, Any]:
    """A demonstrated answer to an agent's call, as the assistant message a chat template renders: after a tool
    result, `answer: ` and its output; else the episode's plan (episode_plan, drawn from `rng`, the episode's own):
    a call of the tool that takes code (code_parameter), or a mental answer."""
    if messages and messages[-1].get("role") == "tool":
        return {"role": "assistant", "content": f"answer: {str(messages[-1].get('content') or '').strip()}"}
    plan = episode_plan(prompt, rng, tool_rate=tool_rate, wrong_code_rate=wrong_code_rate)
    if plan.code is None:
        return {"role": "assistant", "content": f"answer: {plan.answer}"}
    target = code_parameter(tools)
    if target is None:
        names = [str((tool.get("function") or {}).get("name")) for tool in tools]
        raise ValueError(f"tool_multiply's demonstrations call a tool with the product's Python code, but the "
                         f"agent's request offers no tool with a string parameter (its tools: {names or 'none'}); "
                         "give the agent a code tool, or set sft.tool_rate=0")
    name, parameter = target
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_0", "type": "function",
                            "function": {"name": name, "arguments": {parameter: plan.code}}}]}
