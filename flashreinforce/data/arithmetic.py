"""The synthetic verifiable task: multi-digit addition with a worked chain of thought.

An item's prompt is `37+485=`; the completion we teach adds one column per step, right to left,
`a+b+carry=sum;` with the shorter operand padded with 0, then closes the think and gives the sum:

    37+485=  ->  <think>7+5+0=12;3+8+1=12;0+4+1=5;</think>522

The think grows with the number of columns, so a mix of digit counts gives long-tailed completion
lengths. Everything is generated from a seed with the standard library: no downloads, the same items
on every machine. This module knows nothing about tokenizers; it exports the ALPHABET they are built from.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import NamedTuple

from flashreinforce.types import Prompt

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
ALPHABET: tuple[str, ...] = (*"0123456789+=;", THINK_OPEN, THINK_CLOSE)
"""Every token the task's prompts and completions are made of (a tokenizer adds its own EOS / pad)."""
DATA_SOURCE = "arithmetic"
DEFAULT_DIGIT_WEIGHTS: tuple[float, ...] = (0.20, 0.25, 0.25, 0.22, 0.08)
"""Share of problems with 1, 2, 3, 4, 5 columns (digits of the longer operand): few of 5
columns, so think lengths are long-tailed."""

_PROMPT = re.compile(r"(\d+)\+(\d+)=")
# A held-out split takes its problems without replacement; the 1-column problems are only 100, so a
# large held-out split can exhaust a column count. This many failed draws in a row means it did.
_MAX_REJECTIONS = 10_000


class ArithmeticSplits(NamedTuple):
    train: list[Prompt]
    eval: list[Prompt]


def solve(a: int, b: int, dropped: Sequence[bool] = ()) -> tuple[str, str]:
    """The worked think (without tags) and the answer of `a+b=`.

    `dropped[k]` (k = 0 is the ones column) makes step k write carry 0 where the true carry is 1;
    the wrong digit and every later carry follow from it, so the answer is wrong too. Example:
    solve(37, 485) == ("7+5+0=12;3+8+1=12;0+4+1=5;", "522"); dropping column 1's carry gives
    ("7+5+0=12;3+8+0=11;0+4+1=5;", "512").
    """
    assert a >= 0 and b >= 0, f"operands must be non-negative, got {a}, {b}"
    da, db = str(a)[::-1], str(b)[::-1]  # ones digit first
    columns = max(len(da), len(db))
    steps, digits, carry = [], [], 0
    for k in range(columns):
        x = int(da[k]) if k < len(da) else 0
        y = int(db[k]) if k < len(db) else 0
        if carry and k < len(dropped) and dropped[k]:
            carry = 0
        total = x + y + carry
        steps.append(f"{x}+{y}+{carry}={total};")
        # The last column writes its whole sum (it may be two digits); the others keep their ones digit.
        digits.append(str(total) if k == columns - 1 else str(total % 10))
        carry = total // 10
    return "".join(steps), "".join(reversed(digits))


def operands(item: Prompt) -> tuple[int, int]:
    """(a, b) of an arithmetic prompt `a+b=`."""
    match = _PROMPT.fullmatch(item.prompt) if isinstance(item.prompt, str) else None
    if match is None:
        raise ValueError(f"prompt {item.id} is {item.prompt!r}, not an arithmetic prompt like '37+485='")
    return int(match[1]), int(match[2])


def make_item(a: int, b: int, prompt_id: str) -> Prompt:
    """One problem as a Prompt: difficulty = columns, ground truth = the sum, the correct think kept."""
    think, answer = solve(a, b)
    assert int(answer) == a + b, f"solve({a}, {b}) gave {answer}"
    return Prompt(
        id=prompt_id,
        prompt=f"{a}+{b}=",
        ground_truth=answer,
        data_source=DATA_SOURCE,
        reference_think=think,
        difficulty=float(max(len(str(a)), len(str(b)))),
    )


def render_target(item: Prompt, *, carry_drop: float = 0.0, rng: random.Random | None = None) -> str:
    """The SFT completion of an item (what follows its prompt text): `<think>{steps}</think>{answer}`.

    With carry_drop = p > 0, each step whose true carry is 1 writes 0 instead with probability p,
    and the answer follows the wrong steps: imperfect traces (at p = 0.6 the default recipe's warm start scores
    about 50% held-out, docs/benchmarks.md). The tokenizer appends EOS.
    """
    if not 0.0 <= carry_drop <= 1.0:
        raise ValueError(f"carry_drop={carry_drop} is a probability: use a value in [0, 1]")
    if carry_drop > 0 and rng is None:
        raise ValueError("carry_drop > 0 draws random drops: pass rng=random.Random(seed)")
    a, b = operands(item)
    columns = max(len(str(a)), len(str(b)))
    # One draw per column whether or not it carries, so the stream a seed gives does not depend on the digits.
    dropped = [rng.random() < carry_drop for _ in range(columns)] if carry_drop > 0 else []
    think, answer = solve(a, b, dropped)
    return f"{THINK_OPEN}{think}{THINK_CLOSE}{answer}"


def _number(digits: int, rng: random.Random) -> int:
    return rng.randrange(10) if digits == 1 else rng.randrange(10 ** (digits - 1), 10**digits)


def _draw(columns: int, weights: Sequence[float], rng: random.Random) -> tuple[int, int]:
    # The longer operand sets the column count; the other takes a digit count from the same mix cut
    # at `columns`, and a coin decides which one comes first.
    cut = weights[:columns]
    short = rng.choices(range(1, columns + 1), weights=cut)[0] if sum(cut) > 0 else columns
    pair = (_number(columns, rng), _number(short, rng))
    return pair if rng.random() < 0.5 else pair[::-1]


def make_arithmetic_splits(
    num_train: int,
    num_eval: int,
    *,
    seed: int,
    digit_weights: Sequence[float] = DEFAULT_DIGIT_WEIGHTS,
) -> ArithmeticSplits:
    """Train and held-out problems, deterministic from `seed`.

    digit_weights[k] is the share of problems with k + 1 columns (the longer operand's digits), so
    `Prompt.difficulty` follows the mix. Held-out problems are distinct; training problems never
    equal a held-out one (same `a+b=` text) but may repeat among themselves, since small column
    counts have few problems (100 with one column). Ids: "arithmetic/train/000042", "arithmetic/eval/...".
    """
    if num_train < 0 or num_eval < 0:
        raise ValueError(f"num_train={num_train}, num_eval={num_eval}: use counts >= 0")
    weights = [float(w) for w in digit_weights]
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"digit_weights={list(digit_weights)}: give one non-negative weight per digit "
                         "count (1, 2, ...) with a positive sum, e.g. [0.2, 0.25, 0.25, 0.22, 0.08]")
    rng = random.Random(seed)
    held_out: set[tuple[int, int]] = set()

    def sample(split: str, n: int, distinct: bool) -> list[Prompt]:
        items = []
        for i in range(n):
            columns = rng.choices(range(1, len(weights) + 1), weights=weights)[0]
            for _ in range(_MAX_REJECTIONS):
                a, b = _draw(columns, weights, rng)
                if (a, b) not in held_out:
                    break
            else:
                raise ValueError(f"arithmetic {split} split: no {columns}-column problem left outside the "
                                 f"held-out split; lower num_eval ({num_eval}) or the weight of {columns} digits")
            if distinct:
                held_out.add((a, b))
            items.append(make_item(a, b, f"{DATA_SOURCE}/{split}/{i:06d}"))
        return items

    # Held-out first, so the training draws can avoid its problems.
    eval_items = sample("eval", num_eval, distinct=True)
    return ArithmeticSplits(train=sample("train", num_train, distinct=False), eval=eval_items)
