import random
import re
from collections import Counter

import pytest

from flashreinforce.data.arithmetic import (
    ALPHABET,
    THINK_CLOSE,
    THINK_OPEN,
    make_arithmetic_splits,
    make_item,
    operands,
    render_target,
    solve,
)
from flashreinforce.types import Prompt

_TOKEN = re.compile("|".join(re.escape(t) for t in sorted(ALPHABET, key=len, reverse=True)))


@pytest.mark.parametrize(("a", "b", "think", "answer"), [
    (37, 485, "7+5+0=12;3+8+1=12;0+4+1=5;", "522"),      # the docstring example
    (5, 6, "5+6+0=11;", "11"),                           # the last column writes its whole sum
    (0, 0, "0+0+0=0;", "0"),
    (999, 1, "9+1+0=10;9+0+1=10;9+0+1=10;", "1000"),     # a carry through every column
    (40, 3, "0+3+0=3;4+0+0=4;", "43"),                   # the shorter operand is padded with 0
])
def test_solve_worked_steps(a, b, think, answer):
    assert solve(a, b) == (think, answer)


def test_dropped_carry_propagates_into_the_answer():
    # Column 1's carry 1 is written as 0: 3+8+0=11, so its digit is 1, not 2.
    assert solve(37, 485, [False, True]) == ("7+5+0=12;3+8+0=11;0+4+1=5;", "512")
    # Every carry dropped: column 2 then gets 0 too.
    assert solve(37, 485, [True, True, True]) == ("7+5+0=12;3+8+0=11;0+4+0=4;", "412")
    # A drop where the carry is 0 changes nothing.
    assert solve(12, 34, [True, True]) == solve(12, 34)


def test_solve_adds_correctly_and_uses_only_the_alphabet():
    rng = random.Random(0)
    for _ in range(500):
        a, b = rng.randrange(10 ** rng.randint(1, 7)), rng.randrange(10 ** rng.randint(1, 7))
        think, answer = solve(a, b)
        assert int(answer) == a + b
        assert think.count(";") == max(len(str(a)), len(str(b)))
        text = f"{a}+{b}={THINK_OPEN}{think}{THINK_CLOSE}{answer}"
        assert "".join(_TOKEN.findall(text)) == text


def test_alphabet_is_small_and_has_the_think_tags_as_tokens():
    assert len(ALPHABET) == len(set(ALPHABET)) == 15
    assert set("0123456789+=;") | {"<think>", "</think>"} == set(ALPHABET)


def test_make_item_fields():
    item = make_item(37, 485, "t/0")
    assert item == Prompt(id="t/0", prompt="37+485=", ground_truth="522", data_source="arithmetic",
                          reference_think="7+5+0=12;3+8+1=12;0+4+1=5;", difficulty=3.0)
    assert operands(item) == (37, 485)
    with pytest.raises(ValueError, match="not an arithmetic prompt"):
        operands(Prompt(id="q", prompt="What is 2+2?", ground_truth="4"))


def test_render_target_clean_and_with_all_carries_dropped():
    item = make_item(37, 485, "t/0")
    assert render_target(item) == "<think>7+5+0=12;3+8+1=12;0+4+1=5;</think>522"
    assert render_target(item, carry_drop=1.0, rng=random.Random(0)) == "<think>7+5+0=12;3+8+0=11;0+4+0=4;</think>412"
    with pytest.raises(ValueError, match="rng"):
        render_target(item, carry_drop=0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        render_target(item, carry_drop=1.5, rng=random.Random(0))


def test_carry_drop_rate_matches_p():
    # Count, over many items, the steps whose true carry-in is 1 and how many of them write 0.
    items = make_arithmetic_splits(2000, 0, seed=3).train
    rng, carries, dropped = random.Random(1), 0, 0
    for item in items:
        clean = item.reference_think.split(";")[:-1]
        noisy = render_target(item, carry_drop=0.6, rng=rng).removeprefix(THINK_OPEN).split(THINK_CLOSE)[0].split(";")
        for k in range(1, len(clean)):
            true_carry = int(clean[k - 1].split("=")[1]) // 10
            noisy_carry = int(noisy[k - 1].split("=")[1]) // 10
            if true_carry and noisy_carry:  # this step's carry-in was 1: was it written?
                carries += 1
                dropped += noisy[k].split("=")[0].endswith("+0")
    assert carries > 1000
    assert dropped / carries == pytest.approx(0.6, abs=0.04)  # ~4.5 standard errors


def test_splits_are_deterministic_disjoint_and_follow_the_mix():
    train, held_out = make_arithmetic_splits(4000, 256, seed=7)
    assert (train, held_out) == make_arithmetic_splits(4000, 256, seed=7)
    assert make_arithmetic_splits(50, 10, seed=8).eval != make_arithmetic_splits(50, 10, seed=7).eval
    assert len(train) == 4000 and len(held_out) == 256
    assert len({p.id for p in train + held_out}) == 4256
    assert train[42].id == "arithmetic/train/000042" and held_out[3].id == "arithmetic/eval/000003"
    held_out_texts = {p.prompt for p in held_out}
    assert len(held_out_texts) == 256  # held-out problems are distinct
    assert not held_out_texts & {p.prompt for p in train}
    shares = Counter(p.difficulty for p in train)
    for columns, weight in zip(range(1, 6), (0.20, 0.25, 0.25, 0.22, 0.08)):
        assert shares[float(columns)] / 4000 == pytest.approx(weight, abs=0.03)
    for p in train[:200]:
        a, b = operands(p)
        assert int(p.ground_truth) == a + b and p.difficulty == max(len(str(a)), len(str(b)))
        assert render_target(p) == f"<think>{p.reference_think}</think>{p.ground_truth}"


def test_digit_weights_configurable_and_validated():
    train, _ = make_arithmetic_splits(300, 0, seed=0, digit_weights=[0, 0, 1])
    assert {p.difficulty for p in train} == {3.0}
    for bad in ([], [-1, 2], [0, 0]):
        with pytest.raises(ValueError, match="digit_weights"):
            make_arithmetic_splits(10, 10, seed=0, digit_weights=bad)


def test_held_out_that_takes_every_problem_of_a_size_is_an_error():
    # One column only: 100 problems. A held-out split of all of them leaves none for training.
    with pytest.raises(ValueError, match="train split: no 1-column problem left"):
        make_arithmetic_splits(1, 100, seed=0, digit_weights=[1.0])
    with pytest.raises(ValueError, match="eval split"):
        make_arithmetic_splits(0, 101, seed=0, digit_weights=[1.0])
