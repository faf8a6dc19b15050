"""AHRL hint schedule and hinted prompts (ALGORITHMS.md 1.4 properties 1, 2, 4; 3 is in test_objectives.py)."""

import math
from itertools import pairwise

import pytest

from flashreinforce.algorithms import hint_fraction, hinted_prompt


def test_starts_at_p_initial_and_hand_value():
    assert hint_fraction(0, 0.7, p_initial=0.8, gamma=0.5) == 0.8
    assert hint_fraction(100, 0.5, p_initial=0.8, gamma=0.01) == pytest.approx(0.8 * math.exp(-0.5))


def test_non_increasing_in_t_and_constant_without_pass_or_gamma():
    values = [hint_fraction(t, 0.3, p_initial=0.9, gamma=0.1) for t in range(50)]
    assert all(a >= b for a, b in pairwise(values)) and values[-1] < values[0]
    assert {hint_fraction(t, 0.0, p_initial=0.9, gamma=0.1) for t in range(50)} == {0.9}
    assert {hint_fraction(t, 0.4, p_initial=0.9, gamma=0.0) for t in range(50)} == {0.9}


def test_pass_floor_makes_unsolved_prompts_decay():
    assert hint_fraction(10, 0.0, p_initial=0.9, gamma=0.1, pass_floor=0.25) == pytest.approx(0.9 * math.exp(-0.25))


def test_easier_prompts_decay_faster():
    for t in range(0, 40, 7):
        assert hint_fraction(t, 0.8, p_initial=0.9, gamma=0.2) <= hint_fraction(t, 0.2, p_initial=0.9, gamma=0.2)


def test_hinted_prompt_appends_floor_fraction_of_the_think():
    assert hinted_prompt((1, 2), (7, 8, 9), 0.7, think_open_ids=(5,)) == ((1, 2, 5, 7, 8), 3)
    assert hinted_prompt([1, 2], [7, 8, 9], 1.0) == ((1, 2, 7, 8, 9), 3)


@pytest.mark.parametrize("fraction", [0.0, 0.3])
def test_zero_length_hint_leaves_the_prompt_identical(fraction):
    # floor(0.3 * 3) = 0: no opener either
    assert hinted_prompt((1, 2), (7, 8, 9), fraction, think_open_ids=(5,)) == ((1, 2), 0)


def test_hint_length_is_within_the_think():
    think = tuple(range(10, 23))
    for k in range(101):
        prompt, length = hinted_prompt((1,), think, k / 100)
        assert 0 <= length <= len(think) and prompt[1:] == think[:length]


@pytest.mark.parametrize("kwargs", [dict(step=-1), dict(p_initial=1.5), dict(gamma=-0.1), dict(pass_initial=2.0)])
def test_bad_schedule_inputs_raise(kwargs):
    args = dict(step=1, pass_initial=0.5, p_initial=0.5, gamma=0.1) | kwargs
    with pytest.raises(ValueError):
        hint_fraction(args.pop("step"), args.pop("pass_initial"), **args)


def test_a_stage_counts_its_own_steps():
    """HintedPrompts(first_step=s): a stage that starts at global step s hints at step s as a run does at step 0."""
    from flashreinforce.envs.hints import HintedPrompts
    from flashreinforce.envs.single_turn import TextEpisodes
    from flashreinforce.models import build_char_tokenizer
    from flashreinforce.types import Prompt

    episodes = TextEpisodes(build_char_tokenizer("0123456789+=<>/thinkabc ", special_tokens=("<pad>", "<eos>", "<unk>")))
    prompt = Prompt("p", "1+2=", "3", reference_think="1+2=3 abc 1+2=3 abc")
    options = dict(p_initial=0.5, gamma=0.5, pass_threshold=1.0, pass_floor=0.0, think_open="")
    run = HintedPrompts(episodes, {"p": 0.5}, **options)
    stage = HintedPrompts(episodes, {"p": 0.5}, **options, first_step=40)
    assert [stage.hint_ids(prompt, 40 + t) for t in range(4)] == [run.hint_ids(prompt, t) for t in range(4)]
    assert len(run.hint_ids(prompt, 0)) > len(run.hint_ids(prompt, 3)) > 0
