import json
import random
import re
from collections import Counter

import pytest

from flashreinforce.data.instructions import (
    ALPHABET,
    CAPITALS,
    CONSTRAINTS,
    END_PHRASES,
    FREQUENCY,
    POSTSCRIPT,
    TOPICS,
    WORDS,
    count_words,
    demonstration,
    make_instructions_splits,
    render_answer,
    request_of,
)
from flashreinforce.verifiers.ifeval import check_ground_truth, count_words as ifeval_count_words, ifeval_verifier

SPLITS = make_instructions_splits(3000, 256, seed=7)
SCORE = ifeval_verifier()


def test_splits_are_a_function_of_the_seed():
    again = make_instructions_splits(3000, 256, seed=7)
    assert again == SPLITS
    other = make_instructions_splits(3000, 256, seed=8)
    assert [p.prompt for p in other[0][:50]] != [p.prompt for p in SPLITS[0][:50]]


def test_held_out_prompts_are_distinct_and_never_a_training_prompt():
    train, held_out = SPLITS
    texts = [p.prompt for p in held_out]
    assert len(set(texts)) == len(texts) == 256
    assert not set(texts) & {p.prompt for p in train}
    assert [p.id for p in train[:2]] == ["instructions/train/000000", "instructions/train/000001"]
    assert held_out[0].id == "instructions/eval/000000"


def test_difficulty_is_the_number_of_constraints_in_the_weighted_mix():
    train, _ = make_instructions_splits(3000, 0, seed=1, constraint_weights=[1, 0, 3])
    shares = Counter(p.difficulty for p in train)
    assert set(shares) == {1.0, 3.0} and 0.2 < shares[1.0] / len(train) < 0.3
    assert all(len(json.loads(p.ground_truth)["instruction_id_list"]) == p.difficulty for p in train)


def test_every_ground_truth_is_ifeval_json_the_verifier_accepts():
    train, held_out = SPLITS
    seen = Counter()
    for item in [*train, *held_out]:
        check_ground_truth(item.ground_truth)
        ids = json.loads(item.ground_truth)["instruction_id_list"]
        assert len(set(ids)) == len(ids)
        seen.update(ids)
        assert set(item.prompt) <= set(ALPHABET) and item.prompt.endswith("\n")
    assert set(seen) == set(CONSTRAINTS)


def test_prompts_state_their_constraints():
    item = next(p for p in SPLITS[0] if FREQUENCY in p.ground_truth)
    request = request_of(item)
    frequency = next(c for c in request.constraints if c.id == FREQUENCY)
    assert f"Say {frequency.kwargs['keyword']} at least {frequency.kwargs['frequency']} times." in item.prompt
    assert re.match(rf"Name {request.count} \w+\.", item.prompt) and request.topic in TOPICS


def test_a_clean_demonstration_meets_every_constraint():
    rng = random.Random(0)
    for item in [*SPLITS[0][:1500], *SPLITS[1]]:
        answer = demonstration(item, rng, violation_rate=0.0)
        assert set(answer) <= set(ALPHABET)
        verdict = SCORE(answer, item.ground_truth, item)
        assert verdict.reward == 1.0 and verdict.passed, (item.prompt, answer, verdict)


def test_a_violated_constraint_is_the_one_that_fails():
    """Each constraint violated alone fails itself and only itself: the others still hold."""
    rng = random.Random(0)
    for item in SPLITS[0][:600]:
        request = request_of(item)
        for index, constraint in enumerate(request.constraints):
            violated = [i == index for i in range(len(request.constraints))]
            answer = render_answer(request, rng, violated)
            verdict = SCORE(answer, item.ground_truth, item)
            assert verdict.reason == f"failed: {constraint.id}", (item.prompt, answer, verdict)
            assert verdict.reward == pytest.approx(1 - 1 / len(request.constraints))


def test_demonstrations_violate_at_the_configured_rate():
    rng = random.Random(0)
    train = SPLITS[0]
    scores = [SCORE(demonstration(item, rng, violation_rate=0.4), item.ground_truth, item) for item in train]
    met = sum(s.reward * p.difficulty for s, p in zip(scores, train)) / sum(p.difficulty for p in train)
    assert 0.57 < met < 0.63  # each constraint kept with probability 0.6
    assert all(SCORE(demonstration(item, rng, 1.0), item.ground_truth, item).reward == 0 for item in train[:300])


def test_words_are_counted_as_ifeval_counts_them_and_no_keyword_hides_in_another_word():
    rng = random.Random(0)
    for item in SPLITS[0][:300]:
        answer = demonstration(item, rng, violation_rate=0.5)
        assert count_words(answer) == ifeval_count_words(answer)
    # IFEval counts a keyword inside longer words ("cat" in "catch"): no answer word may hold another.
    words = {w for _, topic in TOPICS.values() for w in topic}
    others = words | {w for phrase in [*END_PHRASES, POSTSCRIPT] for w in re.findall(r"\w+", phrase)}
    assert not [(a, b) for a in words for b in others if a != b and a in b]


def test_limits_sit_just_above_the_clean_answer():
    rng = random.Random(0)
    for item in SPLITS[0][:500]:
        request = request_of(item)
        clean = render_answer(request, rng)
        for constraint in request.constraints:
            if constraint.id == WORDS:
                assert 1 <= constraint.kwargs["num_words"] - count_words(clean) <= 2
            if constraint.id == CAPITALS:
                assert 1 <= constraint.kwargs["capital_frequency"] <= request.count


@pytest.mark.parametrize(("settings", "match"), [
    ({"constraints": ["change_case:english_lowercase"]}, r"data.instructions.constraints=.*is not one"),
    ({"constraints": []}, r"data.instructions.constraints=\[\]: choose a non-empty subset"),
    ({"constraint_weights": [0, 0]}, r"data.instructions.constraint_weights=.*positive sum"),
    ({"constraints": ["punctuation:no_comma"], "constraint_weights": [1, 1]}, r"asks for 2 constraints"),
])
def test_bad_settings_name_the_field(settings, match):
    with pytest.raises(ValueError, match=match):
        make_instructions_splits(10, 2, seed=0, **settings)


def test_a_violation_rate_outside_0_1_is_refused():
    with pytest.raises(ValueError, match=r"data.instructions.violation_rate=1.5"):
        demonstration(SPLITS[0][0], random.Random(0), violation_rate=1.5)
