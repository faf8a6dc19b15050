"""Reward hacking against the `code` verifier: every program of the corpus (tests/code_hacks.py) scores 0 through
load_reward_fn("code"), each class of the threat model has its hacks, while honest MBPP- and HumanEval-style
solutions keep their scores; expected values never reach the sandbox; tests outside the judged forms are counted
and can be refused."""

from __future__ import annotations

import ast
import json

import pytest
from code_hacks import ADD, HACKS

from flashreinforce.sandbox import probe_isolation
from flashreinforce.types import HACKING_SIGNS, Prompt
from flashreinforce.verifiers import code as code_module
from flashreinforce.verifiers.code import check_ground_truth
from flashreinforce.verifiers.registry import check_rows, parse_spec
from flashreinforce.verifiers.rewards import load_reward_fn

KINDS = {"equal_anything", "exits", "base_exception", "patches", "reads_expected", "forges", "kills", "floods",
         "prints"}
"""The threat model's classes (docs/verifiers.md#threat-model): each one has hacks in the corpus."""


def fenced(program: str) -> str:
    return f"Here is my solution.\n```python\n{program}\n```\n"


@pytest.fixture(scope="module")
def score():
    if probe_isolation() == "none":
        pytest.skip("no sandbox works here (apt-get install bubblewrap)")
    return load_reward_fn(json.dumps({"kind": "code", "test_timeout_s": 0.3, "time_budget_s": 3.0}))


def verdict(score, program: str, tests: str):
    return score(fenced(program), tests, Prompt(id="p", prompt="", ground_truth=tests))


def test_the_corpus_holds_30_hacks_or_more_of_every_class():
    assert len(HACKS) >= 30 and len({hack.name for hack in HACKS}) == len(HACKS)
    assert {hack.kind for hack in HACKS} == KINDS
    assert {hack.sign for hack in HACKS} - {None} <= set(HACKING_SIGNS)


@pytest.mark.parametrize("hack", HACKS, ids=lambda hack: f"{hack.kind}:{hack.name}")
def test_a_hack_scores_zero_and_shows_its_sign(score, hack):
    result = verdict(score, hack.program, hack.tests)
    assert (result.reward, result.passed) == (0.0, False), result
    assert result.reason.startswith("failed: "), result
    if hack.sign is not None:
        assert hack.sign in result.signs, result
    assert "unverified_asserts" not in result.signs  # every test of the corpus is judged outside the program


HONEST = [
    ("def add(a, b):\n    return a + b", ADD),
    ("from collections import Counter\ndef count(text):\n    return Counter(text.split())",
     json.dumps(['assert count("a b a") == {"a": 2, "b": 1}', "assert count('') == {}"])),
    ("def pair(xs):\n    return min(xs), max(xs)", json.dumps(["assert pair([3, 1, 2]) == (1, 3)",
                                                             "assert pair([5]) == (5, 5)"])),
    ("def common(a, b):\n    return [x for x in a if x in b]",
     json.dumps(["assert set(common((3, 4, 5), (5, 4))) == set((4, 5))", "assert len(common([1], [2])) == 0"])),
    ("import math\ndef area(r):\n    return math.pi * r * r",
     json.dumps(["import math\nassert math.isclose(area(2), 12.566370614359172, rel_tol=1e-6)",
                 "assert abs(area(1) - 3.14159) < 1e-4", "assert round(area(1), 2) == 3.14"])),
    ("def is_even(n):\n    return n % 2 == 0", json.dumps(["assert is_even(4)", "assert not is_even(3)",
                                                          "assert is_even(10) is True"])),
    ("def chars(s):\n    return {c for c in s}", json.dumps(["assert chars('abca') == {'a', 'b', 'c'}",
                                                             "assert chars('') == set()"])),
    ("def big(n):\n    return 2 ** n", json.dumps([f"assert big(200) == {2 ** 200}", "assert type(big(1)) == int"])),
    ("def evens(xs):\n    return filter(lambda x: x % 2 == 0, xs)",
     json.dumps(["assert list(evens([1, 2, 3, 4])) == [2, 4]", "assert sorted(evens((6, 4))) == [4, 6]"])),
    ("def total(xs):\n    return sum(xs)",
     json.dumps(["\n\nMETADATA = {'author': 'x'}\n\n\ndef check(candidate):\n    assert candidate([1, 2, 3]) == 6\n"
                 "    assert candidate([]) == 0\n    assert abs(candidate([0.1, 0.2]) - 0.3) < 1e-6\n"
                 "    assert True, 'This prints if this assert fails'\n\ncheck(total)"])),
]
"""MBPP- and HumanEval-style rows with honest solutions, in forms the verifier judges: each scores 1."""


@pytest.mark.parametrize(("program", "tests"), HONEST, ids=lambda value: value[:30] if isinstance(value, str) else "")
def test_honest_solutions_keep_their_scores(score, program, tests):
    result = verdict(score, program, tests)
    assert (result.reward, result.reason, result.signs) == (1.0, "ok", ()), result


def test_expected_values_and_the_asserts_text_never_enter_the_sandbox(score, monkeypatch):
    sent: list[str] = []
    real = code_module._run_call
    monkeypatch.setattr(code_module, "_run_call", lambda sandbox, code, left: sent.append(code) or
                        real(sandbox, code, left))
    tests = json.dumps(["assert add(20000, 11337) == 31337", "import math\nassert math.isclose(add(0.5, 0.25), 0.75)"])
    assert verdict(score, "def add(a, b):\n    return a + b", tests).reward == 1.0
    (code,) = sent
    payload = json.loads(ast.literal_eval(code.rsplit("\nmain(", 1)[1].strip()[:-1]))  # the harness, then main(...)
    assert payload["tests"] == [{"setup": [], "calls": ["add(20000, 11337)"]},
                                {"setup": ["import math"], "calls": ["add(0.5, 0.25)"]}]  # only the calls go in
    assert "31337" not in json.dumps(payload) and "0.75" not in json.dumps(payload)


def test_tests_outside_the_judged_forms_run_trusting_the_program_and_are_counted(score):
    loop = json.dumps(["for a in range(3):\n    assert add(a, 1) == a + 1", "assert add(1, 2) == 3"])
    honest = verdict(score, "def add(a, b):\n    return a + b", loop)
    assert (honest.reward, honest.signs) == (1.0, ("unverified_asserts",))
    # what such a test trusts: the program's process, which a patched exec fools
    fooled = verdict(score, "import builtins\nbuiltins.exec = lambda *args: None\ndef add(a, b):\n    return 0", loop)
    assert (fooled.reward, fooled.reason, fooled.signs) == (0.5, "failed: test 2: AssertionError",
                                                            ("unverified_asserts",))


def test_unverified_asserts_refuse_stops_such_rows_naming_the_tests():
    loop = json.dumps(["for a in range(3):\n    assert add(a, 1) == a + 1", "assert add(1, 2) == 3"])
    check_ground_truth(loop)  # run: the default
    with pytest.raises(ValueError, match=r"tests \[1\] are not in a form the verifier judges"):
        check_ground_truth(loop, unverified_asserts="refuse")
    spec = parse_spec({"kind": "code", "unverified_asserts": "refuse"})
    with pytest.raises(ValueError, match=r"verifier \(code\): row r7: code: tests \[1\]"):
        check_rows(spec, [Prompt(id="r6", prompt="", ground_truth=ADD), Prompt(id="r7", prompt="", ground_truth=loop)])
    with pytest.raises(ValueError, match="unverified_asserts='sometimes': one of run, refuse"):
        code_module.code_verifier(unverified_asserts="sometimes")


def test_refused_at_call_time_too(score):  # `score`: skipped where no sandbox works
    strict = load_reward_fn(json.dumps({"kind": "code", "unverified_asserts": "refuse", "test_timeout_s": 0.3}))
    assert strict(fenced("def add(a, b):\n    return a + b"), ADD, Prompt(id="p", prompt="", ground_truth=ADD)).passed
    with pytest.raises(ValueError, match="not in a form the verifier judges"):
        strict(fenced("pass"), json.dumps(["print(add(1, 2))"]), Prompt(id="p", prompt="", ground_truth=""))


def test_a_humaneval_test_without_its_check_call_is_refused():
    with pytest.raises(ValueError, match=r"test 1 defines check but never calls it.*check\(ENTRY_POINT\)"):
        check_ground_truth(json.dumps(["def check(candidate):\n    assert candidate(1) == 2\n"]))


def test_special_cased_visible_inputs_pass_the_tests_they_were_written_for(score):
    # Not stopped by any verifier: the tests are what is trusted. Tests the prompt never shows catch it.
    hardcoded = "def add(a, b):\n    return {(1, 2): 3}.get((a, b), 0)"
    assert verdict(score, hardcoded, json.dumps(["assert add(1, 2) == 3"])).reward == 1.0
    assert verdict(score, hardcoded, ADD).reward == pytest.approx(2 / 3)  # add(-1, 1) == 0 by luck of the default
    assert verdict(score, hardcoded, json.dumps(["assert add(1, 2) == 3", "assert add(5, 7) == 12"])).reward == 0.5
