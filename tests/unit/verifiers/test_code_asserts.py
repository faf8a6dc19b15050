"""Assert tests split for the verifier to judge (verifiers/code_asserts.py), pure: which text the program's process
gets, what the verifier computes from the values it sends back, and the wire format both ends speak (the
harness's encoder, code_harness._wire, against the verifier's decoder)."""

from __future__ import annotations

import ast
import binascii
import collections
import json
import math
import re

import pytest

from flashreinforce.verifiers import code_harness
from flashreinforce.verifiers.code_asserts import (
    CALL,
    Failed,
    NotPlain,
    asserts_nothing,
    decode,
    judge,
    judged_test,
    outcomes_of,
    signs,
)


def checks(test) -> list[str]:
    return [ast.unparse(check).replace(CALL, "@") for check in test.checks]


@pytest.mark.parametrize(("source", "calls", "judged"), [
    ("assert add(1, 2) == 3", ["add(1, 2)"], ["@0 == 3"]),
    ("assert set(common((3, 4), (4, 5))) == set((4,))", ["set(common((3, 4), (4, 5)))"], ["@0 == set((4,))"]),
    ("import math\nassert math.isclose(area(2), 12.56, rel_tol=1e-6)", ["area(2)"],
     ["math.isclose(@0, 12.56, rel_tol=1e-06)"]),
    ("from math import isclose\nassert isclose(g(1), 2.0)", ["g(1)"], ["isclose(@0, 2.0)"]),
    ("assert abs(area(1) - 3.14159) < 1e-4", ["area(1)"], ["abs(@0 - 3.14159) < 0.0001"]),
    ("assert round(f(2), 2) == 3.14", ["f(2)"], ["round(@0, 2) == 3.14"]),
    ("assert is_even(4)", ["is_even(4)"], ["@0"]),
    ("assert not is_even(3)", ["is_even(3)"], ["not @0"]),
    ("assert is_even(10) is True", ["is_even(10)"], ["@0 is True"]),
    ("assert f(x) is not None", ["f(x)"], ["@0 is not None"]),
    ("assert 3 in f(5)", ["f(5)"], ["3 in @0"]),
    ("assert 0 < f(5) <= 10", ["f(5)"], ["0 < @0 <= 10"]),
    ("assert f(1) == 1 and f(2) == 2, 'message'", ["f(1)", "f(2)"], ["@0 == 1 and @1 == 2"]),
    ("assert isinstance(f(1), list)", ["f(1)"], ["isinstance(@0, list)"]),
    ("assert type(f(1)) == int", ["f(1)"], ["type(@0) == int"]),  # a type cannot travel: taken here
    ("assert len(f(x)) == 3", ["len(f(x))"], ["@0 == 3"]),
    ("assert f(x)[0] == 'a'", ["f(x)[0]"], ["@0 == 'a'"]),
    ("assert sorted(f(x)) == sorted([3, 1, 2])", ["sorted(f(x))"], ["@0 == sorted([3, 1, 2])"]),
    ("assert f(1) == float('inf') and f(2) == -3", ["f(1)", "f(2)"], ["@0 == float('inf') and @1 == -3"]),
    ("x = [1, 2]\nassert f(x) == x", ["f([1, 2])"], ["@0 == [1, 2]"]),  # a bound constant is written in
    ("assert f(lambda x: x + 1) == 2", ["f(lambda x: x + 1)"], ["@0 == 2"]),
    ("METADATA = {'author': 'x'}\n\ndef check(candidate):\n    '''doc'''\n    assert candidate([1]) == 1\n"
     "    assert abs(candidate([2]) - 2) < 1e-6\n\ncheck(total)", ["total([1])", "total([2])"],
     ["@0 == 1", "abs(@1 - 2) < 1e-06"]),
])
def test_the_common_forms_send_only_their_calls(source, calls, judged):
    test = judged_test(source)
    assert list(test.calls) == calls and checks(test) == judged
    sent = json.dumps({"setup": test.setup, "calls": test.calls})
    for literal in ("== 3", "12.56", "3.14159", "'a'", "[3, 1, 2]", "== 1", "- 2)", "rel_tol"):
        assert literal not in sent  # no expected value, no comparison, none of the assert's text


@pytest.mark.parametrize("source", [
    "assert f(1) == f(2)",  # the program would judge itself
    "for i in range(3):\n    assert f(i) == i",
    "result = f(1)\nassert result == 2",
    "def helper():\n    return 1\nassert f(helper()) == 1",  # a helper the program's process lacks
    "assert f(x) is 3",
    "from collections import Counter\nassert f('aab') == Counter('aab')",  # the expected side uses the program's names
    "print(f(1))",
    "def check(candidate):\n    for x in range(3):\n        assert candidate(x) == x\n\ncheck(f)",
    "assert f(1) == 1\nf.cache_clear()",
])
def test_other_tests_are_not_judged_here(source):
    assert judged_test(source) is None


def test_imports_run_before_the_calls_and_math_is_the_verifiers_own():
    test = judged_test("import math as m\nfrom math import pi\nassert m.isclose(area(1), pi)\n"
                       "assert m.floor(f(2.5)) == 2")
    # m.floor holds no expected value: it is part of the call, in the program's namespace where the import put it
    assert test.setup == ("import math as m", "from math import pi") and test.calls == ("area(1)", "m.floor(f(2.5))")
    assert judge(test, [3.141592653589793, 2]) == (True, "")
    assert judge(test, [3.0, 2]) == (False, "AssertionError")


def test_the_checks_run_in_order_over_values_and_failed_calls():
    test = judged_test("def check(candidate):\n    assert candidate(1) == 1\n    assert candidate(2) == 4\n"
                       "    assert candidate(3) == 9\n\ncheck(square)")
    assert judge(test, [1, 4, 9]) == (True, "")
    assert judge(test, [1, 5, 9]) == (False, "AssertionError")
    assert judge(test, [1, Failed("NameError: name 'y' is not defined"), 9]) == \
        (False, "NameError: name 'y' is not defined")
    assert judge(test, [2, Failed("exited (SystemExit: 0)", "exited_early"), 9]) == (False, "AssertionError")
    # an `or` needs only what it reads, as Python would
    either = judged_test("assert f(1) == 1 or f(2) == 2")
    assert judge(either, [1, Failed("ZeroDivisionError: division by zero")]) == (True, "")


def test_comparisons_are_of_plain_data_only():
    test = judged_test("assert f(1) == (1, 2)\nassert f(2) < 3\nassert f(3) == {'a': 1}")
    assert judge(test, [(1, 2), 2, {"a": 1}]) == (True, "")
    assert judge(test, [[1, 2], 2, {"a": 1}]) == (False, "AssertionError")  # a list is not a tuple
    assert judge(test, [(1, 2), "2", {"a": 1}]) == \
        (False, "TypeError: '<' not supported between instances of 'str' and 'int'")


def test_the_verifiers_arithmetic_refuses_what_would_be_huge():
    test = judged_test("assert f(1) * 10 == 'x'\nassert f(2) % 3 == 'y'")
    assert judge(test, ["a" * 200_000, "a"])[1].startswith("OverflowError: a sequence of 2000000 items")
    assert judge(test, ["x" * 0, "%999999999d"]) == (False, "AssertionError")  # '' * 10 is small and wrong
    assert judge(judged_test("assert f(2) % 3 == 'y'"), ["%999999999d"])[1] == \
        "TypeError: string formatting is not evaluated by the verifier"
    assert judge(judged_test("assert f(1) ** 10 ** 9 == 2"), [3])[1].startswith("OverflowError")


def test_a_test_that_defines_a_check_but_never_calls_it_asserts_nothing():
    assert asserts_nothing("def check(candidate):\n    assert candidate(1) == 2\n") == ["check"]
    assert asserts_nothing("def check(candidate):\n    assert candidate(1) == 2\n\ncheck(f)") == []
    assert asserts_nothing("assert f(1) == 2") == []


# ---- the wire ---------------------------------------------------------------------------------------------------

PLAIN = [None, True, False, 0, -7, 2**80, -(2**70), 1.5, float("inf"), -0.0, "", "é\ud800", b"\x00\xff",
         [1, [2, [3]]], (1, "a"), (), {1, 2}, frozenset({(1, 2)}), {"a": [1], (1, 2): {3}}, set(),
         collections.Counter("aab"), collections.OrderedDict(b=1, a=2), collections.defaultdict(int, {"k": 3})]


@pytest.mark.parametrize("value", PLAIN, ids=repr)
def test_plain_values_cross_the_wire_as_they_are(value):
    wire = json.loads(json.dumps(code_harness._wire(value, 0, [1 << 20])))
    back = decode(wire)
    expected = dict(value) if isinstance(value, dict) else value
    assert back == expected and type(back) is type(expected)


def test_nan_crosses_and_compares_as_python_does():
    back = decode(json.loads(json.dumps(code_harness._wire(float("nan"), 0, [100]))))
    assert math.isnan(back) and back != back  # noqa: PLR0124 - NaN is unequal to itself: the comparison the test names


class Mine:
    pass


class Int(int):
    pass


@pytest.mark.parametrize(("value", "what"), [
    (Mine(), "a Mine object"), (Int(3), "an int subclass (Int)"), (True.__class__, "a type object"),
    (lambda: 0, "a function object"), ((i for i in ()), "a generator object"), (range(3), "a range object"),
    (collections.deque([1]), "a deque object"), (collections.namedtuple("P", "x")(1), "a tuple subclass (P)"),
    ([Mine()], "a Mine object"), ({1: Mine()}, "a Mine object"),
])
def test_anything_else_is_not_plain_data(value, what):
    with pytest.raises(code_harness._NotPlain, match=f"^{re.escape(what)}$"):
        code_harness._wire(value, 0, [1 << 20])


def test_values_too_deep_too_big_or_holding_themselves_are_not_sent():
    loop: list = []
    loop.append(loop)
    deep: list = []
    for _ in range(100):
        deep = [deep]
    for value in (loop, deep):
        with pytest.raises(code_harness._NotPlain, match="nested over 64 deep"):
            code_harness._wire(value, 0, [1 << 20])
    with pytest.raises(code_harness._NotPlain, match="past the output cap"):
        code_harness._wire("x" * 1000, 0, [1000])


@pytest.mark.parametrize("wire", [
    {"tuple": 3}, {"set": [[1]]}, {"dict": [[1]]}, {"dict": [[[1], 2]]}, {"int": "12"}, {"bytes": "zz"},
    {"list": [1]}, {"tuple": [1], "set": [1]}, [{"what": 1}], {"int": "0x" + "f" * 10, "x": 1},
])
def test_the_decoder_refuses_what_the_harness_never_writes(wire):
    with pytest.raises(NotPlain):
        decode(wire)


def test_a_frames_values_are_read_strictly():
    def sent(items) -> str:
        return binascii.b2a_base64(json.dumps(items).encode(), newline=False).decode()

    assert outcomes_of(sent([{"value": {"tuple": [1, 2]}}, {"value": 3}]), 2) == [(1, 2), 3]
    failed = outcomes_of(sent([{"error": "KeyboardInterrupt", "base": True}, {"exit": 0, "detail": "SystemExit: 0"},
                               {"nonplain": "an int subclass (I)"}, {"value": {"set": [[]]}}]), 4)
    assert [f.why for f in failed] == ["KeyboardInterrupt", "exited (SystemExit: 0)",
                                       "returned an int subclass (I), not plain data",
                                       "returned an unreadable set, not plain data"]
    assert signs(failed) == {"base_exception", "exited_early", "not_plain"}
    unreadable = Failed("sent no readable result", "not_plain")
    for values in (sent([{"value": 1}]), "not base64!", sent({"value": 1}), None, sent("[" * 100_000),
                   binascii.b2a_base64(b"[[[" * 50_000).decode()):
        assert outcomes_of(values, 2) == [unreadable, unreadable]
