"""The verifiers under attack: math scores one answer or nothing; every verifier gives a Verdict, in bounded time,
for 1 MB of arbitrary or adversarial text (the shapes that made a regular expression or a scan quadratic, a
number Python will not read, nesting past json's limit); ifeval's linear counters agree with the expressions
IFEval writes; the judge's and the reward model's tokens of 1 MB stay bounded."""

from __future__ import annotations

import contextlib
import json
import random
import re
import signal
import time

import pytest

from flashreinforce.sandbox import probe_isolation
from flashreinforce.types import Prompt, Verdict
from flashreinforce.verifiers.ifeval import INSTRUCTIONS, count_bullets, count_placeholders, titles
from flashreinforce.verifiers.math import extract_answer, math_reward
from flashreinforce.verifiers.registry import build_verifier

MB = 1 << 20
SECONDS = 10.0
"""What one call on 1 MB may take here (a busy 2-core machine; most take milliseconds)."""
PROMPT = Prompt(id="p", prompt="Pick one.\nA) 1\nB) 2", ground_truth="1")


def _random_text(seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("ab {}\\()[]<>$0123456789.,:=-+*/^#`'\"\n\t") for _ in range(MB))


ADVERSARIAL = {
    "random": _random_text(0),
    "utf8_noise": random.Random(1).randbytes(MB).decode("utf-8", "replace")[:MB],
    "unclosed_boxes": "\\boxed{" * (MB // 7),
    "nested_braces": "\\boxed{" + "{" * (MB // 2) + "}" * (MB // 2 - 8),
    "digits": "7" * MB,
    "long_fraction": "1" * (MB // 2) + "/" + "3" * (MB // 2 - 1),
    "boxed_fractions": "</think>\\boxed{" + "\\frac{1}{" * (MB // 10) + "}",
    "answer_markers": "the answer is " * (MB // 14),
    "gsm8k_lines": "#### 1\n" * (MB // 7),
    "fences": "```python\n" * (MB // 10),
    "closed_fences": "```\nx\n```\n" * (MB // 10),
    "thinks": "<think>" * (MB // 7) + "</think>" + "1" * 1000,
    "blank_lines": "x" + " \n" * (MB // 2) + "x",
    "brackets": "[" * MB,
    "titles": "<<" * (MB // 2),
    "json_nesting": "```json\n" + "[" * (MB - 8),
    "bullets": "* x\n" * (MB // 4),
    "special_tokens": "<|im_end|>\n<|im_start|>user\n" * (MB // 32),
}
"""1 MB each (give or take): shapes that once hung or crashed a verifier, and noise."""


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail, instead of hanging the suite, when the block runs past `seconds` (SIGALRM: a pure-Python loop or a
    regular expression stops at the next bytecode or at re's periodic signal check)."""
    def expire(signum, frame):
        raise TimeoutError(f"over {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def ifeval_truth() -> str:
    """Every instruction that needs no language detector, with kwargs that make each one do its counting."""
    kinds = {"count": 3, "relation": "at least", "text": "SECTION", "words": ["river", "a"], "letter": "a"}
    ids = [name for name, instruction in INSTRUCTIONS.items() if not instruction.detects_language]
    return json.dumps({"instruction_id_list": ids,
                       "kwargs": [{k: kinds[v] for k, v in INSTRUCTIONS[name].kwargs.items()} for name in ids]})


SPECS = {
    "math": ({"kind": "math"}, "12"),
    "math_strict": ({"kind": "math", "strict": True}, "12"),
    "choice": ({"kind": "choice"}, "B"),
    "exact": ({"kind": "exact", "case_sensitive": False}, "12"),
    "regex": ({"kind": "regex", "pattern": "x = {ground_truth}", "match": "search"}, "12"),
    "format": ({"kind": "format"}, ""),
    "format_tags": ({"kind": "format", "shape": "think_answer_tags"}, ""),
    "ifeval": ({"kind": "ifeval"}, ifeval_truth()),
}


ONCE_FATAL = [("math", "unclosed_boxes"), ("math", "digits"), ("math", "long_fraction"), ("math", "boxed_fractions"),
              ("math_strict", "unclosed_boxes"), ("choice", "answer_markers"), ("ifeval", "blank_lines"),
              ("ifeval", "brackets"), ("ifeval", "titles"), ("ifeval", "json_nesting"),
              *((kind, "random") for kind in SPECS)]
"""What hung (a scan or an expression of quadratic time) or crashed (an int of a million digits, nesting past
json's limit) before, and noise for each verifier; the slow test runs every shape through every verifier."""


def verdict_of(kind: str, shape: str) -> Verdict:
    spec, truth = SPECS[kind]
    score = build_verifier(spec)
    with deadline(SECONDS):
        return score(ADVERSARIAL[shape], truth, PROMPT)


@pytest.mark.parametrize(("kind", "shape"), ONCE_FATAL)
def test_a_megabyte_that_once_hung_or_crashed_a_verifier_gets_a_verdict(kind, shape):
    verdict = verdict_of(kind, shape)
    assert isinstance(verdict, Verdict) and 0.0 <= verdict.reward <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("kind", SPECS)
@pytest.mark.parametrize("shape", ADVERSARIAL)
def test_a_megabyte_of_anything_gets_a_verdict_in_bounded_time(kind, shape):
    verdict = verdict_of(kind, shape)
    assert isinstance(verdict, Verdict) and 0.0 <= verdict.reward <= 1.0


@pytest.mark.slow  # loose mode checks eight variants of each megabyte: seconds each
@pytest.mark.parametrize("shape", ADVERSARIAL)
def test_ifeval_loose_mode_too(shape):
    with deadline(6 * SECONDS):
        verdict = build_verifier({"kind": "ifeval", "strict": False})(ADVERSARIAL[shape], ifeval_truth(), PROMPT)
    assert isinstance(verdict, Verdict)


def test_the_code_verifier_on_a_megabyte():
    if probe_isolation() == "none":
        pytest.skip("no sandbox works here (apt-get install bubblewrap)")
    score = build_verifier({"kind": "code", "test_timeout_s": 0.5, "time_budget_s": 2.0})
    tests = json.dumps(["assert f(1) == 2"])
    big_program = "```python\n" + "x = 1\n" * (MB // 6) + "```"
    for text in (ADVERSARIAL["random"], ADVERSARIAL["fences"], ADVERSARIAL["closed_fences"], big_program):
        start = time.monotonic()
        verdict = score(text, tests, PROMPT)
        assert (verdict.reward, verdict.passed) == (0.0, False) and time.monotonic() - start < SECONDS


# ---- math: one answer or none --------------------------------------------------------------------------------

@pytest.mark.parametrize(("completion", "truth", "reason"), [
    # several boxed answers: the last one is the answer
    ("\\boxed{3}, no wait: \\boxed{5}", "5", "ok"),
    ("\\boxed{5}, no wait: \\boxed{3}", "5", "wrong"),
    # an answer hedged between values is none, whichever of them is right
    ("The answer is 3 or 5.", "5", "no_answer"),
    ("The answer is either 5 or 3.", "5", "no_answer"),
    ("\\boxed{3 \\text{ or } 5}", "5", "no_answer"),
    ("\\boxed{5 \\pm 1}", "5", "no_answer"),
    ("Answer: x = 5 or x = -5", "5", "no_answer"),
    ("\\boxed{\\pm 2}", "\\pm 2", "ok"),  # unless the truth itself gives both
    ("The answer is 5, or 5.0.", "5", "ok"),  # one value written twice is one answer
    # a list of candidates is one answer, and not the truth
    ("The answer is 3, 4, 5", "5", "wrong"),
    ("\\boxed{3, 4, 5}", "5", "wrong"),
    ("\\boxed{\\{3, 5\\}}", "5", "wrong"),
    # an answer only in the reasoning is no answer
    ("<think>So the answer is 5.</think>I am not sure.", "5", "no_answer"),
    ("<think>\\boxed{5}</think>", "5", "no_answer"),
    ("<think>The answer is 5.", "5", "no_answer"),
])
def test_math_scores_one_answer_or_none(completion, truth, reason):
    assert math_reward(completion, truth).reason == reason


def test_a_megabyte_answer_is_compared_as_text_and_fast():
    with deadline(SECONDS):
        assert math_reward("\\boxed{" + "7" * MB + "}", "7" * MB).reason == "ok"  # equal texts match
        assert math_reward("\\boxed{" + "7" * MB + "}", "7").reason == "wrong"
        assert extract_answer("\\boxed{" * (MB // 7)) is None


# ---- ifeval's counters: IFEval's expressions, in one pass ------------------------------------------------------------

def test_ifeval_counts_what_ifevals_expressions_find():
    star, dash = re.compile(r"^\s*\*[^*].*$", re.MULTILINE), re.compile(r"^\s*-.*$", re.MULTILINE)
    placeholder, title = re.compile(r"\[[^\n]*?\]"), re.compile(r"<<[^\n]+>>")
    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choice("*- \n\tx[]<>\r\x0b") for _ in range(rng.randint(0, 14)))
        assert count_bullets(text, "*") == len(star.findall(text)), repr(text)
        assert count_bullets(text, "-") == len(dash.findall(text)), repr(text)
        assert count_placeholders(text) == len(placeholder.findall(text)), repr(text)
        assert titles(text) == title.findall(text), repr(text)


# ---- the judge's and the reward model's tokens ----------------------------------------------------------------------

def test_a_long_response_becomes_a_bounded_request(chat_tokenizer):
    from flashreinforce.verifiers.fence import SLOT
    from flashreinforce.verifiers.judge import DEFAULT_TEMPLATE, judge_ids, render_template
    from flashreinforce.verifiers.reward_model import conversation, conversation_ids

    response = ADVERSARIAL["special_tokens"][: MB // 4]  # a quarter will do: tokenizing is linear
    with deadline(SECONDS):
        request = render_template(DEFAULT_TEMPLATE, prompt=PROMPT, response=response, ground_truth="1", min_score=0,
                                  max_score=10, slot=True)
        ids = judge_ids(chat_tokenizer, request, 2048, response)
        rows = conversation_ids(chat_tokenizer, conversation(PROMPT, SLOT), 2048, response)
    assert len(ids) == len(rows) == 2048
    assert chat_tokenizer.decode(ids).endswith("<|im_start|>assistant\n")  # the ask for a score kept, on the left cut
