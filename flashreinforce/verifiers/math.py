r"""Math answer checking, pure: find the final answer in a completion, compare it with the truth.

extract_answer reads only what follows the last `</think>` (the think is scratch work) and gives up
on a think that never closes. In that text it takes, in order: the last \boxed{...}, the later of the
phrase "the answer is X" / "answer: X" and a GSM8K-style line "#### X" (X a bare answer with a digit, so
that a markdown heading "#### Step 1: add" is not one), the text itself when it is a bare answer, else the
last number (`strict`: a marked answer or none). Markdown bold around or inside the marked answer
("**Answer:** 42") is ignored. A boxed or marked answer that hedges between values ("3 or 5", "\\boxed{4 \\pm 1}")
is no answer: one answer is scored, never the best of several.
answers_equal compares normalized strings, then numbers (ints, decimals, fractions, percents,
thousands commas; exact rational arithmetic), then expressions with sympy (verifiers/symbolic.py).
Nothing here runs user code or bounds time: verifiers/pool.py runs these calls under a timeout.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction

from flashreinforce.data.arithmetic import THINK_CLOSE, THINK_OPEN
from flashreinforce.types import NO_ANSWER, Prompt, Verdict
from flashreinforce.verifiers.registry import check_bool_options
from flashreinforce.verifiers.symbolic import symbolic_equal

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")
_HEDGE = re.compile(r"\bor\b|\\pm|±|\\mp|\\lor|∨", re.IGNORECASE)
_ANSWER_IS = re.compile(r"answer\s*(?:is\s*:?|:)\s*", re.IGNORECASE)
_HASHES = re.compile(r"^[ \t]*####[ \t]*([^\n]*)$", re.MULTILINE)  # GSM8K's final line: "#### 72"
_BOLD = re.compile(r"\*\*")
# A number: a minus sign unless it is a subtraction (3-5), thousands commas, decimals, a /denominator
# and a percent sign. "1,2,3" is three numbers; "1,234" is one.
_NUMBER = re.compile(r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:/\d+)?%?")
# Words of prose ("apples", "so") make a span more than an answer; LaTeX commands (\frac) and these
# function names do not.
_WORD = re.compile(r"(?<![\\\w])[A-Za-z]{2,}")
_MATH_WORDS = frozenset({"sqrt", "pi", "sin", "cos", "tan", "log", "ln", "exp", "oo", "inf", "infty"})
_LATEX_NOISE = re.compile(r"\\left|\\right|\\[,;:! ]|\\displaystyle|\^\s*\{?\\circ\}?|°")
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")
_LATEX_FRAC = re.compile(r"([-+]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
MAX_NUMBER_CHARS = 1000
"""A longer answer is not read as a number (equal texts still match)."""


def extract_answer(text: str, *, strict: bool = False, hedges: bool = False) -> str | None:
    r"""The final answer in a completion, or None. `strict`: only a marked answer (boxed, "answer: X", "####
    X"), never the text's last number, which in an agent's final turn may be a number in its code. `hedges`: a
    boxed or marked answer may give several values (when the truth itself does: "\pm 2").

    >>> extract_answer("<think>7+5+0=12;0+4+1=5;</think>52")
    '52'
    >>> extract_answer(r"so x = \boxed{\frac{1}{2}}.")
    '\\frac{1}{2}'
    """
    text = text.replace("\u2212", "-")  # unicode minus
    closed = text.rfind(THINK_CLOSE)
    if closed >= 0:
        text = text[closed + len(THINK_CLOSE):]
    elif THINK_OPEN in text:
        return None  # the model never finished thinking: numbers in the think are not its answer
    boxed = _last_boxed(text)
    if boxed is not None:
        return None if _hedged(boxed) and not hedges else boxed.strip() or None
    marked = _marked_answer(text)
    if marked is not None:
        return None if _hedged(marked) and not hedges else _answer_in(marked)
    if strict:
        return None
    if closed >= 0:
        return _answer_in(text)
    return _last_number(text)


def answers_equal(pred: str, truth: str) -> bool:
    """Whether a predicted answer means the ground truth: "1/2" == "0.5" == r"\\frac{1}{2}", "50%" == "50"."""
    a, b = _normalize(pred), _normalize(truth)
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = parse_number(a), parse_number(b)
    if x is not None and y is not None:
        (u, u_percent), (v, v_percent) = x, y
        # A percent matches its number either way: "50%" is 50 and 0.5.
        return u == v or (u_percent and u / 100 == v) or (v_percent and v / 100 == u)
    return symbolic_equal(a, b)


def math_reward(completion: str, ground_truth: str, *, strict: bool = False) -> Verdict:
    """1 with reason "ok" when the extracted answer equals the truth; 0 with "wrong" or "no_answer"."""
    answer = extract_answer(completion, strict=strict, hedges=_hedged(ground_truth))
    if answer is None:
        return NO_ANSWER
    if answers_equal(answer, ground_truth):
        return Verdict(reward=1.0, passed=True, reason="ok")
    return Verdict(reward=0.0, passed=False, reason="wrong")


def parse_number(text: str) -> tuple[Fraction, bool] | None:
    r"""(exact value, written as a percent) of a plain number, or None: "-1,234.5", "3/4", "\frac{3}{4}", "12%"."""
    text = _normalize(text)
    if len(text) > MAX_NUMBER_CHARS:
        return None  # compared as text only: Python will not read an int of thousands of digits
    percent = text.endswith("%")
    text = text.rstrip("%").removesuffix("\\")  # "12\%" is LaTeX for 12%
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    frac = _LATEX_FRAC.fullmatch(text)
    if frac is not None:
        sign, top, bottom = frac.groups()
        text = f"{sign}{top}/{bottom}" if "/" not in top + bottom else ""
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    top, _, bottom = text.partition("/")
    if bottom and int(bottom) == 0:
        return None
    return Fraction(top) / (Fraction(bottom) if bottom else 1), percent


def _normalize(text: str) -> str:
    """Drop what changes the look of an answer but not its meaning: $, spaces, \\left, degrees, a final period."""
    text = text.replace("\u2212", "-").replace("$", "")
    text = _LATEX_TEXT.sub(r"\1", _LATEX_NOISE.sub("", text))
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    return "".join(text.split()).rstrip(".")


def _marked_answer(text: str) -> str | None:
    """The span after the last answer marker ("the answer is", "answer:", a "#### X" line) up to the end of
    its sentence, without markdown bold; None when there is no marker."""
    said = [match.end() for match in _ANSWER_IS.finditer(text)]
    hashes = [match.start(1) for match in _HASHES.finditer(text) if _bare_number_line(match[1])]
    if not said and not hashes:
        return None
    line = _BOLD.sub("", text[max(said + hashes):].split("\n", 1)[0])
    return re.split(r"\.(?:\s|$)", line, maxsplit=1)[0]


def _hedged(span: str) -> bool:
    """Whether an answer offers several values: two different numbers and an "or" or a plus-minus between them."""
    if not _HEDGE.search(span):
        return False
    values = {parse_number(number) for number in _NUMBER.findall(span[:MAX_NUMBER_CHARS])}
    return len({value[0] for value in values if value is not None}) > 1 or "\\pm" in span or "±" in span


def _bare_number_line(line: str) -> bool:
    """Whether a "####" line holds an answer ("72", "$1,000", "-3/4") rather than a heading ("Step 1: add")."""
    line = _BOLD.sub("", line)
    return any(c.isdigit() for c in line) and not any(word.lower() not in _MATH_WORDS for word in _WORD.findall(line))


def _answer_in(span: str) -> str | None:
    """A span that is only an answer ("x+1", r"\frac{1}{2}", "y = 5" -> "5") as is; inside prose, its last number."""
    if any(word.lower() not in _MATH_WORDS for word in _WORD.findall(span)):
        return _last_number(span)
    span = span.split("=")[-1].strip().strip("$").strip().rstrip(".")
    return span or None


def _last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} whose braces balance (nested braces included), in one pass over the text
    (a scan from each box's brace would take quadratic time on many unclosed boxes)."""
    starts = [match.end() for match in _BOXED.finditer(text)]
    if not starts:
        return None
    closes, opened = {}, []
    for brace in _BRACE.finditer(text):
        if brace[0] == "{":
            opened.append(brace.start())
        elif opened:
            closes[opened.pop()] = brace.start()
    return next((text[start:closes[start - 1]] for start in reversed(starts) if start - 1 in closes), None)


def math_verifier(*, strict: bool = False) -> Callable[[str, str, Prompt], Verdict]:
    """The registry's `math`: math_reward on the completion. `strict`: a completion must mark its answer (as
    verl's strict GSM8K format demands "####"): a tool agent's final turn that only echoes the product in code
    (`<code>print(119340)</code>`) has given no answer, though its last number is right."""
    check_bool_options("math", strict=strict)
    return lambda completion, ground_truth, prompt: math_reward(completion, ground_truth, strict=strict)
