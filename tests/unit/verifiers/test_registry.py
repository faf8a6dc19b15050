"""The unified verifier system's registry: specs from a recipe, options checked, sums and routes, and the
reference strings that carry a spec to the pool's worker processes."""

import pytest

from flashreinforce.types import Prompt
from flashreinforce.verifiers.registry import (
    FACTORIES,
    VerifierSpec,
    build_verifier,
    check_routes,
    parse_spec,
    spec_ref,
)
from flashreinforce.verifiers.pool import VerifierPool
from flashreinforce.verifiers.rewards import load_reward_fn

PROMPT = Prompt(id="p", prompt="2+3=", ground_truth="5", data_source="sums")


def test_a_spec_is_a_name_a_mapping_with_kind_or_a_route():
    assert parse_spec("math") == VerifierSpec("math")
    assert parse_spec({"kind": "sum", "parts": [{"kind": "math"}]}) == VerifierSpec("sum", (("parts", [{"kind": "math"}]),))
    assert parse_spec({"route": {"a": "math"}}).kind == "route"
    with pytest.raises(ValueError, match=r"tasks.x.verifier: unknown verifier 'maths'; the registered ones: .*math"):
        parse_spec("maths", field="tasks.x.verifier")
    with pytest.raises(ValueError, match="a mapping needs `kind`"):
        parse_spec({"weight": 1})


def test_the_math_verifier_by_name_is_the_answer_checker():
    assert build_verifier("math")("<think>2+3+0=5;</think>5", "5", PROMPT).passed
    assert not build_verifier("math")("<think>2+3+0=6;</think>6", "5", PROMPT).passed


def test_an_unknown_or_missing_option_names_it_and_the_options_there_are():
    with pytest.raises(ValueError, match=r"verifier: math has no option 'stric'; its options: strict"):
        build_verifier({"kind": "math", "stric": True})
    with pytest.raises(ValueError, match=r"verifier: sum: .*missing 1 required keyword-only argument: 'parts'"):
        build_verifier({"kind": "sum"})


def test_a_weighted_sum_keeps_each_parts_reward_and_passes_when_every_part_does():
    score = build_verifier({"kind": "sum", "parts": [{"kind": "math", "weight": 0.75},
                                                     {"kind": "math", "name": "again", "weight": 0.25}]})
    verdict = score("<think>2+3+0=5;</think>5", "5", PROMPT)
    assert (verdict.reward, verdict.passed, verdict.parts) == (1.0, True, (("math", 1.0), ("again", 1.0)))
    wrong = score("<think>2+3+0=6;</think>6", "5", PROMPT)
    assert (wrong.reward, wrong.passed, wrong.reason) == (0.0, False, "wrong")
    with pytest.raises(ValueError, match="repeat a name"):
        build_verifier({"kind": "sum", "parts": [{"kind": "math"}, {"kind": "math"}]})


def test_a_route_sends_each_row_to_its_data_sources_verifier_and_start_up_names_the_unrouted():
    spec = parse_spec({"route": {"sums": "math"}})
    assert build_verifier(spec)("<think>2+3+0=5;</think>5", "5", PROMPT).passed
    other = Prompt(id="q", prompt="x", ground_truth="5", data_source="trivia")
    assert build_verifier(spec)("5", "5", other).reason == "no_route: trivia"
    check_routes(spec, ["sums"])
    with pytest.raises(ValueError, match=r"data_source 'trivia' have no route; .*routed now: sums; the registered"):
        check_routes(spec, ["sums", "trivia"])
    check_routes(parse_spec("math"), ["anything"])  # a verifier that does not route takes every row


def test_a_spec_travels_to_the_workers_as_a_reference_and_comes_back_the_same_verifier():
    spec = parse_spec({"kind": "sum", "parts": [{"kind": "math", "weight": 0.5}]})
    ref = spec_ref(spec)
    assert ref.startswith("{") and spec_ref(parse_spec("math")) == "math"
    assert load_reward_fn(ref)("<think>2+3+0=5;</think>5", "5", PROMPT).reward == 0.5
    assert load_reward_fn("math")("<think>2+3+0=5;</think>5", "5", PROMPT).passed
    with VerifierPool([ref], timeout_s=5.0, min_workers=1, max_workers=1) as pool:  # a worker process builds it
        verdict = pool.score_sync("<think>2+3+0=5;</think>5", PROMPT)
    assert (verdict.reward, verdict.parts) == (0.5, (("math", 1.0),))


def test_every_registered_factory_names_a_module_and_function():
    assert all(":" in target and target.startswith("flashreinforce.verifiers.") for target in FACTORIES.values())


CALLS: list[list[str]] = []
"""The completions of each score_batch call of `length_verifier`."""


def length_verifier(*, batch_size: int = 4):
    """A batchable test verifier: reward = the completion's length, recording each batch it scores."""
    from flashreinforce.verifiers.registry import BatchedRewardFn

    def score_batch(completions, ground_truths, prompts):
        CALLS.append(list(completions))
        return [float(len(c)) for c in completions]
    return BatchedRewardFn(score_batch, batch_size)


@pytest.fixture
def batchable_kind(monkeypatch):
    monkeypatch.setitem(FACTORIES, "length", f"{__name__}:length_verifier")
    CALLS.clear()
    return CALLS


def test_a_sum_or_route_with_a_batchable_part_scores_a_batch_through_it_at_once(batchable_kind):
    from flashreinforce.verifiers.registry import batch_size_of, score_rows

    rows = [Prompt(id=f"p{i}", prompt="x", ground_truth="5", data_source=("sums", "text")[i % 2]) for i in range(4)]
    completions = ["<think>2+3+0=5;</think>5", "ab", "<think>2+3+0=6;</think>6", "abcd"]
    total = build_verifier({"kind": "sum", "parts": [{"kind": "math", "weight": 1.0},
                                                     {"kind": "length", "batch_size": 6, "weight": 0.5}]})
    assert batch_size_of(total) == 6
    verdicts = score_rows(total, completions, ["5"] * 4, rows)
    assert batchable_kind == [completions]  # the batchable part saw the four rows in one call
    assert [v.reward for v in verdicts] == [1.0 + 0.5 * len(c) if i == 0 else 0.5 * len(c)
                                            for i, c in enumerate(completions)]
    assert verdicts[0].parts == (("math", 1.0), ("length", float(len(completions[0]))))

    batchable_kind.clear()
    routed = build_verifier({"route": {"sums": "math", "text": {"kind": "length"}}})
    assert batch_size_of(routed) == 4
    values = score_rows(routed, completions, ["5"] * 4, rows)
    assert batchable_kind == [["ab", "abcd"]]  # only the text rows, together
    assert [getattr(v, "reward", v) for v in values] == [1.0, 2.0, 0.0, 4.0]
    assert batch_size_of(build_verifier({"route": {"sums": "math"}})) == 1  # nothing batchable: one row per call
