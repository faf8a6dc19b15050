import json

import pytest

from flashreinforce.buffer import Ledger
from flashreinforce.types import RolloutKey

A, B, C = RolloutKey("a", 0), RolloutKey("a", 1), RolloutKey("b", 0)


def test_marks_summary_and_outstanding():
    ledger = Ledger()
    for key in (A, B, C):
        ledger.schedule(key)
    ledger.train(A, step=3)
    ledger.drop(C, "stale")
    assert ledger.summary() == {"scheduled": 3, "trained": 1, "outstanding": 1, "dropped/stale": 1}
    assert ledger.outstanding() == [B]
    assert ledger.trained() == {A: 3} and ledger.dropped() == {C: "stale"}
    assert ledger.status(A) == 3 and ledger.status(B) is None and ledger.status(C) == "stale"
    assert A in ledger and RolloutKey("z", 0) not in ledger and len(ledger) == 3
    ledger.check()


@pytest.mark.parametrize("marks, problem, a_status", [
    (lambda l: (l.train(A, 1), l.train(A, 2)), "trained at step 2 but already trained at step 1", 1),
    (lambda l: (l.train(A, 1), l.drop(A, "stale")), "dropped (stale) but already trained at step 1", 1),
    (lambda l: (l.drop(A, "stale"), l.train(A, 4)), "trained at step 4 but already dropped (stale)", "stale"),
    (lambda l: (l.drop(A, "filtered"), l.drop(A, "stale")), "dropped (stale) but already dropped (filtered)",
     "filtered"),
    (lambda l: l.train(C, 0), "trained at step 0 but never scheduled", None),
    (lambda l: l.drop(C, "stale"), "dropped (stale) but never scheduled", None),
    (lambda l: l.schedule(A), "scheduled twice", None),
])
def test_check_names_each_violation_and_the_first_outcome_stays(marks, problem, a_status):
    ledger = Ledger()
    ledger.schedule(A)
    marks(ledger)
    with pytest.raises(AssertionError, match="violated 1 times") as err:
        ledger.check()
    offender = C if "never scheduled" in problem else A
    assert f"{offender}: {problem}" in str(err.value)
    assert ledger.status(A) == a_status
    assert C not in ledger  # a bad mark never creates an entry
    summary = ledger.summary()
    assert summary["scheduled"] == 1
    assert summary["trained"] + summary["outstanding"] + sum(
        n for k, n in summary.items() if k.startswith("dropped/")) == 1, summary


def test_first_outcome_wins():
    ledger = Ledger()
    ledger.schedule(A)
    ledger.train(A, 1)
    ledger.train(A, 2)
    ledger.drop(A, "stale")
    assert ledger.status(A) == 1 and ledger.summary() == {"scheduled": 1, "trained": 1, "outstanding": 0}
    with pytest.raises(AssertionError, match="violated 2 times"):
        ledger.check()


def test_check_reports_many_keys_compactly():
    ledger = Ledger()
    for i in range(50):
        ledger.train(RolloutKey(f"k{i}", 0), 0)
    with pytest.raises(AssertionError, match=r"violated 50 times(.|\n)*and 30 more"):
        ledger.check()


def test_bad_marks_are_value_errors():
    ledger = Ledger()
    ledger.schedule(A)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        ledger.train(A, -1)
    with pytest.raises(ValueError, match="reason must be a non-empty string"):
        ledger.drop(A, "")
    assert ledger.status(A) is None


def test_state_dict_survives_json_and_restores_counts_and_violations():
    ledger = Ledger()
    for key in (A, B, C):
        ledger.schedule(key)
    ledger.train(A, 0)
    ledger.drop(B, "filtered")
    ledger.train(B, 1)  # a violation travels with the state
    state = json.loads(json.dumps(ledger.state_dict()))
    restored = Ledger()
    restored.load_state_dict(state)
    assert restored.state_dict() == ledger.state_dict()
    assert restored.summary() == ledger.summary() == {"scheduled": 3, "trained": 1, "outstanding": 1,
                                                        "dropped/filtered": 1}
    assert restored.outstanding() == [C]
    with pytest.raises(AssertionError, match="already dropped"):
        restored.check()


def test_corrupt_state_is_rejected():
    with pytest.raises(ValueError, match="entry \\('a', 0\\) has status"):
        Ledger().load_state_dict({"entries": [["a", 0, [1]]], "violations": []})


def test_a_large_run_stays_cheap():
    ledger = Ledger()
    keys = [RolloutKey(f"train/{i:06d}", 0) for i in range(50_000)]
    for key in keys:
        ledger.schedule(key)
    for i, key in enumerate(keys):
        if i % 10 == 0:
            ledger.drop(key, "stale")
        else:
            ledger.train(key, i // 128)
    ledger.check()
    assert ledger.summary() == {"scheduled": 50_000, "trained": 45_000, "outstanding": 0, "dropped/stale": 5_000}
    restored = Ledger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.summary() == ledger.summary()
