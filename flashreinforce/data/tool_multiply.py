"""The tool task: multi-digit multiplication, where one Python call makes the answer easy and mental
arithmetic (a small model's) does not.

A prompt is `a*b=` (or, for a chat model, a user message asking for a*b and saying how to call the tool); a good
episode writes `<code>print(a*b)</code>`, reads `<output>N</output>` and answers `answer: N`. Warm-start traces mix
tool episodes, mental answers (right for small products, with a digit off for large ones, as a model's guesses
are) and wrong code (`a+b`), so RL has a policy to fix.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

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


def tool_trace(prompt: Prompt, rng: random.Random, *, tool_rate: float, wrong_code_rate: float) -> list[TraceTurn]:
    """One warm-start episode: the tool with probability tool_rate (wrong code with wrong_code_rate), else a
    mental answer."""
    a, b = operands(prompt)
    if rng.random() >= tool_rate:
        return [TraceTurn(f"answer: {mental_guess(a, b, rng)}", None)]
    wrong = rng.random() < wrong_code_rate
    value = a + b if wrong else a * b
    code = f"print({a}+{b})" if wrong else f"print({a}*{b})"
    return [TraceTurn(f"{CODE_OPEN}{code}{CODE_CLOSE}", f"{OUT_OPEN}{value}{OUT_CLOSE}"),
            TraceTurn(f"answer: {value}", None)]
