import pytest

from flashreinforce.types import Prompt, Verdict
from flashreinforce.verifiers.math import answers_equal, extract_answer, math_reward, parse_number
from flashreinforce.verifiers.registry import build_verifier
from flashreinforce.verifiers.symbolic import symbolic_equal


@pytest.mark.parametrize(("text", "answer"), [
    # boxed: the last one, nested braces kept whole
    (r"so x = \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{1} no wait \boxed{\frac{a}{b^{2}}}", r"\frac{a}{b^{2}}"),
    (r"\boxed{3} and an unclosed \boxed{4", "3"),
    # "the answer is" / "answer:" up to the end of the sentence; in prose, its last number
    ("The answer is 42. Next question", "42"),
    ("The answer is $x^2+1$.", "x^2+1"),
    ("Final Answer: 1,234 apples", "1,234"),
    # after </think>: the bare answer, or the last number of prose; the think itself is not read
    ("<think>7+5+0=12;3+8+1=12;0+4+1=5;</think>522", "522"),
    ("<think>so 99</think> y = 5", "5"),
    ("<think>x</think>The total is 522 apples.", "522"),
    (r"<think>\boxed{1}</think>\boxed{2}", "2"),
    # no think tags: the last number (minus signs only when not a subtraction)
    ("We get 3-5 = -2", "-2"),
    ("costs 50% more", "50%"),
    ("from 1,2,3 pick 0.5", "0.5"),
    ("3 \u2212 7 = \u22124", "-4"),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("text", [
    "<think>7+5+0=12;3+8+1=12;",   # the think never closed: its numbers are scratch work, not an answer
    "<think>2+2=4</think>",         # closed, then nothing
    "no numbers here",
    "",
])
def test_no_answer(text):
    assert extract_answer(text) is None


@pytest.mark.parametrize(("pred", "truth"), [
    ("522", "522"),
    ("0.5", "1/2"),
    (r"\frac{1}{2}", ".5"),
    (r"\dfrac{3}{4}", "0.75"),
    ("-\\frac{1}{2}", "-0.5"),
    ("1,234", "1234"),
    ("3.0", "3"),
    ("50%", "50"),
    (r"50\%", "0.5"),
    (r"90^\circ", "90"),
    ("$5$", " 5 "),
    ("2(x+1)", "2x+2"),
    ("x^2-1", "(x-1)(x+1)"),
    (r"\sqrt{8}", r"2\sqrt{2}"),
    (r"\frac{\pi}{2}", r"\pi/2"),
    (r"\sqrt[3]{8}", "2"),
    ("sin(x)^2+cos(x)^2", "1"),
    ("2^{10}", "1024"),
])
def test_equal(pred, truth):
    assert answers_equal(pred, truth)
    assert answers_equal(truth, pred)


@pytest.mark.parametrize(("pred", "truth"), [
    ("521", "522"),
    ("0.333", "1/3"),           # numbers compare exactly, not to a tolerance
    ("50%", "5"),
    ("x+1", "y+1"),
    ("10^300", "10^300+1"),     # exact even where a float tolerance could not tell
    ("1/0", "2/0"),             # undefined is not equal to undefined
    ("pi", "3.14159"),
    ("", "5"),
    ("5", ""),
])
def test_not_equal(pred, truth):
    assert not answers_equal(pred, truth)


@pytest.mark.parametrize("hostile", [
    "9^9^9",                             # would be computed exactly without the exponent check
    "(x+1)^100000",
    "__import__('os').system('true')",   # outside the character whitelist
    "x.__class__",
    "1" + "+x" * 500,                    # over the length cap
    r"\unknown{3}",
])
def test_hostile_input_is_refused_quickly(hostile):
    assert not symbolic_equal(hostile, "1")


def test_parse_number():
    assert parse_number("-1,234.5") == (-2469 / 2, False)
    assert parse_number("12%") == (12, True)
    assert parse_number(r"\frac{3}{4}") == (0.75, False)
    assert parse_number("3/0") is None and parse_number("x") is None and parse_number("1,23") is None


def test_math_reward_reasons():
    assert math_reward("<think>2+3+0=5;</think>5", "5") == Verdict(reward=1.0, passed=True, reason="ok")
    assert math_reward("<think>2+3+0=5;</think>6", "5") == Verdict(reward=0.0, passed=False, reason="wrong")
    assert math_reward("<think>2+3+0=5;", "5") == Verdict(reward=0.0, passed=False, reason="no_answer")
    assert math_reward(r"It is \boxed{\frac{10}{2}}", "5").passed


@pytest.mark.parametrize(("text", "passed"), [
    ("answer: 119340", True),
    (r"so \boxed{119340}", True),
    ("The answer is 119,340.", True),
    ("#### 119340", True),
    ("<code>print(119340)</code>", False),  # an agent's final turn that only echoes the product in code
    ("<think>918*130</think>119340", False),
    ("119340", False),
    ("answer: 119341", False),
])
def test_strict_math_takes_only_a_marked_answer(text, passed):
    verify = build_verifier({"kind": "math", "strict": True})
    verdict = verify(text, "119340", Prompt("p", "918*130=", "119340"))
    assert verdict.passed is passed
    assert verdict.reason == ("ok" if passed else "wrong" if "119341" in text else "no_answer")
    assert build_verifier("math")(text, "119340", Prompt("p", "918*130=", "119340")).passed is ("119341" not in text)


def test_strict_must_be_a_boolean():
    with pytest.raises(ValueError, match="math: option `strict` is 'yes'; use true or false"):
        build_verifier({"kind": "math", "strict": "yes"})
