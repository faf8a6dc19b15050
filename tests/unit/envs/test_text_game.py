import dataclasses
import random

import pytest

from flashreinforce.envs.protocol import Env, EnvSpec, build_env
from flashreinforce.envs.text_game import (
    INVALID,
    OUT_OF_STEPS,
    TEXT_GAME_ALPHABET,
    LayoutOptions,
    TextGameEnv,
    admissible_actions,
    apply_action,
    initial_state,
    layout_of,
    layout_signature,
    layout_split,
    make_layout,
    noisy_expert_trace,
    parse_layout_spec,
    solve,
    text_game_prompts,
)
from flashreinforce.types import Prompt

TRAIN = text_game_prompts(200, split="train", seed=0)
EVAL = text_game_prompts(60, split="eval", seed=0)


def play(env, prompt, actions):
    observations = [env.reset(prompt, seed=0)]
    results = [env.step(a) for a in actions]
    return observations + [r.observation for r in results], results


def in_alphabet(text):
    return set(text) <= set(TEXT_GAME_ALPHABET)


def test_the_env_is_built_by_its_kind_and_fits_the_protocol():
    env = build_env(EnvSpec("text_game", {"max_steps": 5}))
    assert isinstance(env, Env) and env.max_steps == 5
    with pytest.raises(ValueError, match="max_steps"):
        TextGameEnv(max_steps=0)


def test_the_oracle_solves_every_train_layout_within_max_steps_and_replays_identically():
    env, fresh = TextGameEnv(), TextGameEnv()
    for prompt in TRAIN:
        actions = solve(layout_of(prompt))
        assert 2 <= len(actions) <= 6 <= env.max_steps and prompt.difficulty == len(actions)
        observations, results = play(env, prompt, actions)
        assert [r.done for r in results] == [False] * (len(actions) - 1) + [True]
        assert results[-1].reward == 1.0 and results[-1].info["success"] is True
        assert sum(r.reward for r in results) == 1.0
        # A checkpoint rebuilds an episode by replaying its actions into a fresh reset.
        assert play(fresh, prompt, actions)[0] == observations


def test_train_and_eval_layouts_are_disjoint_distinct_and_deterministic():
    train = {layout_signature(layout_of(p)) for p in TRAIN}
    held_out = {layout_signature(layout_of(p)) for p in EVAL}
    assert len(train) == len(TRAIN) and len(held_out) == len(EVAL)
    assert not train & held_out
    assert all(layout_split(layout_of(p)) == "eval" for p in EVAL)
    # Another seed gives other layouts, still never an eval one.
    other = {layout_signature(layout_of(p)) for p in text_game_prompts(200, split="train", seed=1)}
    assert other != train and not other & held_out
    assert text_game_prompts(20, split="eval", seed=0) == EVAL[:20]
    assert len({p.id for p in TRAIN + EVAL}) == len(TRAIN) + len(EVAL)
    assert all(p.data_source == "text_game" and p.prompt == f"find the {layout_of(p).goal}." for p in EVAL)


def test_a_layout_is_a_pure_function_of_its_seed_and_options():
    uncached = make_layout.__wrapped__
    assert uncached(123, LayoutOptions()) == make_layout(123, LayoutOptions())
    assert uncached(123, LayoutOptions()) != uncached(124, LayoutOptions())
    assert uncached(123, LayoutOptions(rooms=5)) != uncached(123, LayoutOptions())


def test_a_good_policy_must_read_the_observation():
    layouts = [layout_of(p) for p in TRAIN]
    assert len({solve(layout)[0] for layout in layouts}) >= 5
    # No fixed action sequence (here: the most common optimal one) solves more than a small share of layouts.
    solutions = [tuple(solve(layout)) for layout in layouts]
    common = max(set(solutions), key=solutions.count)
    env = TextGameEnv()
    solved = sum(play(env, p, common)[1][-1].info["success"] for p in TRAIN)
    assert solved < 0.2 * len(TRAIN)


def test_every_prompt_observation_and_action_uses_only_the_alphabet():
    env, rng = TextGameEnv(), random.Random(0)
    for prompt in TRAIN[:60] + EVAL[:20]:
        trace = noisy_expert_trace(layout_of(prompt), rng, error_rate=0.4)
        texts = [prompt.prompt, trace.final_observation, *(t for turn in trace.turns for t in turn)]
        observations, _ = play(env, prompt, ["dance!! 42", "go n", "take the key"])
        assert all(in_alphabet(t) for t in texts + observations), [t for t in texts if not in_alphabet(t)]


def test_the_observation_signposts_exits_and_offers_admissible_actions():
    prompt = Prompt(id="p", prompt="find the shed.", ground_truth="layout:19071445")
    layout = layout_of(prompt)
    assert layout.goal == "shed"  # a pinned layout: the key lies in the start room, behind n is the goal
    first = TextGameEnv().reset(prompt, seed=0)
    assert first == ("room: cellar. items: green key.\nn(green): shed.\ne: den.\ns: loft.\n"
                     "actions: go e|go s|take green key")
    assert solve(layout) == ["take green key", "unlock n", "go n"]


def test_locks_need_their_key_and_an_inadmissible_action_costs_a_turn_but_changes_nothing():
    layouts = [layout_of(p) for p in TRAIN]
    assert all(any(a.startswith("unlock ") for a in solve(layout)) for layout in layouts)
    prompt = Prompt(id="p", prompt="find the shed.", ground_truth="layout:19071445")
    env = TextGameEnv(max_steps=3)
    start = env.reset(prompt, seed=0)
    locked = env.step("go n")  # the locked door
    assert locked.observation == f"{INVALID}\n{start}" and locked.info == {"success": False, "invalid": True}
    assert env.step("  take green key \n go n").observation.startswith("room: cellar. inv: green key.")
    last = env.step("unlock n")
    assert (last.observation, last.reward, last.done, last.info["success"]) == (OUT_OF_STEPS, 0.0, True, False)
    with pytest.raises(AssertionError, match="reset"):
        env.step("go n")
    state = initial_state(layout_of(prompt))
    assert apply_action(layout_of(prompt), state, "unlock n") is None  # no key yet
    assert "unlock n" not in admissible_actions(layout_of(prompt), state)


def test_the_episode_seed_does_not_change_the_game():
    env, prompt = TextGameEnv(), TRAIN[3]
    assert env.reset(prompt, seed=1) == env.reset(prompt, seed=99)


def test_noisy_expert_traces_err_recover_and_sometimes_fail_and_replay_into_the_env():
    layouts = [layout_of(p) for p in TRAIN[:80]]
    perfect = noisy_expert_trace(layouts[0], random.Random(0), error_rate=0.0)
    assert perfect.success and [t.action for t in perfect.turns] == solve(layouts[0])
    rng = random.Random(1)
    traces = [noisy_expert_trace(layout, rng, error_rate=0.3) for layout in layouts]
    successes = sum(t.success for t in traces)
    assert 0.3 * len(traces) < successes < len(traces)
    assert any(trace.turns[0].action != solve(layout)[0] for layout, trace in zip(layouts, traces))
    assert any(t.success and len(t.turns) > len(solve(layout)) for layout, t in zip(layouts, traces))  # recovered
    env = TextGameEnv()
    for prompt, trace in zip(TRAIN[:80], traces):
        observations, results = play(env, prompt, [t.action for t in trace.turns])
        assert observations == [t.observation for t in trace.turns] + [trace.final_observation]
        assert results[-1].info["success"] == trace.success
    with pytest.raises(ValueError, match="error_rate"):
        noisy_expert_trace(layouts[0], rng, error_rate=1.5)


def test_difficulty_knobs_shape_the_layouts():
    hard = text_game_prompts(30, split="train", seed=0, rooms=6, locked_doors=2, max_solution=8)
    for prompt in hard:
        layout = layout_of(prompt)
        assert len(layout.rooms) == 6 and sum(bool(d.lock) for d in layout.doors) == 2
        assert len(solve(layout)) <= 8 and parse_layout_spec(prompt.ground_truth)[1].locked_doors == 2
    easy = [layout_of(p) for p in text_game_prompts(30, split="train", seed=0, rooms=3, locked_doors=0)]
    assert all(not any(d.lock for d in layout.doors) and len(solve(layout)) == 2 for layout in easy)
    assert {p.id for p in hard}.isdisjoint(p.id for p in TRAIN)


def test_bad_options_and_ground_truths_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match="rooms=9"):
        LayoutOptions(rooms=9)
    with pytest.raises(ValueError, match="locked_doors=3 must be an int in \\[0, 2\\]"):
        LayoutOptions(rooms=3, locked_doors=3)
    with pytest.raises(ValueError, match="layout options are"):
        text_game_prompts(3, split="train", seed=0, room=4)
    with pytest.raises(ValueError, match="split='test'"):
        text_game_prompts(3, split="test", seed=0)
    with pytest.raises(ValueError, match="unknown field 'doors'"):
        parse_layout_spec("layout:1 doors:2")
    with pytest.raises(ValueError, match="names no layout"):
        parse_layout_spec("rooms:4")
    with pytest.raises(ValueError, match="prompt bad: .*needs an integer"):
        TextGameEnv().reset(Prompt(id="bad", prompt="x", ground_truth="layout:seven"), seed=0)
    assert parse_layout_spec("layout:7") == (7, LayoutOptions())
    assert dataclasses.replace(LayoutOptions(), rooms=5).rooms == 5
