import math

import pytest

from flashreinforce.envs.hints import HintedPrompts, longest_hinted_prompt
from flashreinforce.envs.single_turn import TextEpisodes, to_trajectory
from flashreinforce.models import build_char_tokenizer
from flashreinforce.types import FORCED_VERSION, Generation, Prompt, RolloutKey, SamplingParams, Verdict

TOKENIZER = build_char_tokenizer("0123456789+=;")
EPISODES = TextEpisodes(TOKENIZER)
THINK = "7+5+0=12;3+8+1=12;0+4+1=5;"  # 27 characters, one token each
HARD = Prompt(id="hard", prompt="37+485=", ground_truth="522", reference_think=THINK)
EASY = Prompt(id="easy", prompt="1+1=", ground_truth="2", reference_think="1+1+0=2;")
BARE = Prompt(id="bare", prompt="2+2=", ground_truth="4")


def hints(p_initial=0.8, gamma=0.01, floor=0.0):
    return HintedPrompts(EPISODES, {"hard": 0.5, "easy": 1.0, "bare": 0.0}, p_initial=p_initial, gamma=gamma,
                         pass_threshold=0.5, pass_floor=floor, think_open="<think>")


def test_only_hard_prompts_with_a_reference_think_qualify():
    schedule = hints()
    assert schedule.qualifies(HARD)
    assert not schedule.qualifies(EASY)  # pass 1.0 > threshold 0.5
    assert not schedule.qualifies(BARE)  # no reference think
    assert schedule.prompt_ids(EASY, 0) == EPISODES.prompt_ids(EASY)


def test_step_zero_reveals_floor_of_p_initial_of_the_think_after_the_opener():
    ids = hints().prompt_ids(HARD, 0)
    base = EPISODES.prompt_ids(HARD)
    length = math.floor(0.8 * len(THINK))  # 21 think tokens
    assert ids[: len(base)] == base
    assert TOKENIZER.decode(ids[len(base):]) == "<think>" + THINK[:length]
    assert len(hints().hint_ids(HARD, 0)) == 1 + length


def test_the_hint_fades_with_steps_and_a_zero_hint_is_the_plain_prompt():
    schedule = hints()
    lengths = [len(schedule.hint_ids(HARD, t)) for t in (0, 100, 1000)]
    expected_100 = math.floor(0.8 * math.exp(-0.01 * 100 * 0.5) * len(THINK))
    assert lengths[0] > lengths[1] == 1 + expected_100
    assert lengths[2] == 0
    assert hints(p_initial=0.0).prompt_ids(HARD, 0) == EPISODES.prompt_ids(HARD)


def test_hint_tokens_are_prompt_never_trained():
    ids = hints().prompt_ids(HARD, 0)
    generation = Generation(request_id="hard#0", prompt_ids=tuple(ids), token_ids=(5, 6), behavior_logprobs=(-1.0, -2.0),
                            policy_versions=(0, 0), loss_mask=(1, 1), finish_reason="stop", params=SamplingParams())
    hint_length = len(hints().hint_ids(HARD, 0))
    trajectory = to_trajectory(RolloutKey("hard", 0), HARD, 0, generation, Verdict(1.0, True), hint_length=hint_length)
    assert trajectory.hint_length == hint_length > 0
    assert trajectory.loss_mask == (0,) * len(ids) + (1, 1)
    assert trajectory.num_policy_tokens == 2  # |y_i| counts only generated tokens
    assert set(trajectory.policy_versions[: len(ids)]) == {FORCED_VERSION}


@pytest.mark.parametrize("step", [-1])
def test_negative_steps_are_refused(step):
    with pytest.raises(ValueError, match="step"):
        hints().prompt_ids(HARD, step)


def test_the_longest_hinted_prompt_bounds_every_prompt_at_every_step_before_the_pass_rates_are_known():
    prompts = [HARD, EASY, BARE]
    bound = longest_hinted_prompt(EPISODES, prompts, p_initial=0.8, think_open="<think>")
    assert bound == len(EPISODES.prompt_ids(HARD)) + 1 + math.floor(0.8 * len(THINK))  # HARD at step 0
    for pass_rates in ({"hard": 0.0, "easy": 0.0, "bare": 0.0}, {"hard": 0.5, "easy": 1.0}):
        schedule = HintedPrompts(EPISODES, pass_rates, p_initial=0.8, gamma=0.01, pass_threshold=1.0,
                                 pass_floor=0.0, think_open="<think>")
        assert max(len(schedule.prompt_ids(p, t)) for p in prompts for t in (0, 5, 500)) <= bound
    assert longest_hinted_prompt(EPISODES, [BARE], p_initial=1.0, think_open="<think>") == len(EPISODES.prompt_ids(BARE))
