"""extract_answer on the formats of GSM8K ("#### N") and of reasoning-gym's numeric tasks, and markdown bold."""

import pytest

from flashreinforce.verifiers.math import extract_answer, math_reward


@pytest.mark.parametrize(("text", "answer"), [
    # GSM8K's final line, also when prose follows it (the last number would be wrong there)
    ("48/2 = 24 clips in May.\n#### 72", "72"),
    ("#### 10\nSo she has 10 apples out of 20.", "10"),
    ("#### $1,000", "1,000"),
    ("#### -3/4", "-3/4"),
    ("#### **18**", "18"),
    # a markdown heading is not a final answer line, even with a number in it
    ("#### Step 1: add\n3+4=7", "7"),
    ("#### 1. Calculate\nWe get 7", "7"),
    # the later marker wins
    ("The answer is 5.\n#### 6", "6"),
    ("#### 6\nThe answer is 5.", "5"),
    # markdown bold around the answer or the marker
    ("Therefore, the answer is **42**.", "42"),
    ("**Answer:** 42", "42"),
    ("The answer is **-3/4**", "-3/4"),
    # reasoning-gym's numeric answers: commas, negative numbers, fractions, decimals
    ("The answer is 1,234.", "1,234"),
    ("The answer is -15.", "-15"),
    ("The simplified fraction is 138/583.", "138/583"),
    ("The answer is 0.3125", "0.3125"),
    ("The answer is 42 legs.", "42"),
])
def test_marked_answers(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(("completion", "truth"), [
    ("#### 1,234", "1234"),
    ("The answer is $1,000.", "1000"),
    ("The answer is -6.", "-6"),
    ("So 3 - 9 = -6", "-6"),
    ("The answer is 5/16.", "0.3125"),
    ("The answer is **14**.", "14"),
])
def test_reasoning_gym_and_gsm8k_answers_score(completion, truth):
    assert math_reward(completion, truth).passed
