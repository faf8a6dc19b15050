from pathlib import Path

import numpy as np
import pytest

from flashreinforce.types import Prompt, Verdict
from flashreinforce.verifiers.rewards import load_reward_fn, resolve_reward_ref, to_verdict

SAMPLES = Path(__file__).with_name("sample_rewards.py")
PROMPT = Prompt(id="p", prompt="2+3=", ground_truth="5")


def test_builtin_math():
    fn = load_reward_fn("math")
    assert fn("<think>2+3+0=5;</think>5", "5", PROMPT) == Verdict(reward=1.0, passed=True, reason="ok")


def test_file_and_module_references(monkeypatch):
    assert load_reward_fn(f"{SAMPLES}:exact")("5", "5", PROMPT) is True
    monkeypatch.syspath_prepend(str(SAMPLES.parent))
    assert load_reward_fn("sample_rewards:scaled")("0.25", "5", PROMPT) == 0.25


def test_relative_file_reference_is_made_absolute(monkeypatch):
    monkeypatch.chdir(SAMPLES.parent)
    assert resolve_reward_ref("sample_rewards.py:exact") == f"{SAMPLES}:exact"
    assert resolve_reward_ref("pkg.module:fn") == "pkg.module:fn"
    assert resolve_reward_ref("math") == "math"


@pytest.mark.parametrize(("ref", "message"), [
    ("nope", r"use a registered verifier \(choice, .*math, .*\)"),
    ("missing.py:fn", r"'missing.py:fn': file missing.py not found .*fix the path"),
    (f"{SAMPLES}:absent", r"has no 'absent' \(it defines \[.*'exact'.*\]\); fix the name"),
    (f"{SAMPLES}:not_callable", r"not_callable is a int, not a function"),
    (f"{SAMPLES}:two_args", r"cannot be called as two_args\(completion, ground_truth, prompt\)"),
    ("no_such_package_xyz.mod:fn", r"importing module no_such_package_xyz.mod failed with ModuleNotFoundError"),
    ("json:dumps", r"cannot be called as dumps"),
    (f"{SAMPLES}:", r"use a registered verifier"),
])
def test_load_errors_name_the_reference_and_the_fix(ref, message):
    with pytest.raises(ValueError, match=message):
        load_reward_fn(ref)


def test_syntax_and_import_errors_in_the_file(tmp_path):
    (tmp_path / "broken.py").write_text("def reward(c, g, p)\n    return 1\n")
    with pytest.raises(ValueError, match=r"importing .*broken.py failed with SyntaxError.*fix the file"):
        load_reward_fn(f"{tmp_path}/broken.py:reward")
    (tmp_path / "needs.py").write_text("import not_a_real_module_abc\n")
    with pytest.raises(ValueError, match="ModuleNotFoundError"):
        load_reward_fn(f"{tmp_path}/needs.py:reward")


@pytest.mark.parametrize(("value", "verdict"), [
    (True, Verdict(reward=1.0, passed=True, reason="ok")),
    (False, Verdict(reward=0.0, passed=False, reason="wrong")),
    (0.25, Verdict(reward=0.25, passed=True, reason="ok")),
    (-1, Verdict(reward=-1.0, passed=False, reason="wrong")),
    (np.float32(0.5), Verdict(reward=0.5, passed=True, reason="ok")),
    (Verdict(reward=0.5, passed=False, reason="style"), Verdict(reward=0.5, passed=False, reason="style")),
])
def test_to_verdict(value, verdict):
    assert to_verdict(value) == verdict


@pytest.mark.parametrize("value", [None, "1.0", float("nan"), float("inf"), [1.0], Verdict(reward="1", passed=True)])
def test_wrong_return_values_are_error_verdicts(value):
    verdict = to_verdict(value)
    assert verdict.reward == 0.0 and not verdict.passed
    assert verdict.reason.startswith("error: reward function returned")
