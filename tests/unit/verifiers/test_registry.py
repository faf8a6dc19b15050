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
    with pytest.raises(ValueError, match=r"verifier: math has no option 'strict'; its options: none"):
        build_verifier({"kind": "math", "strict": True})
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
