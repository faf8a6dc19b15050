"""record.stitch: an agent episode's calls as token rows, stitched where a call extends an earlier one token for
token."""

from flashreinforce.endpoint.record import fingerprint, stitch
from flashreinforce.types import FORCED_VERSION, CallRecord, Generation, SamplingParams

PARAMS = SamplingParams(max_new_tokens=8)


def call(index: int, prompt: list[int], sampled: list[int], version: int = 0, finish: str = "stop") -> CallRecord:
    n = len(sampled)
    generation = Generation(request_id=f"ep#0@{index}", prompt_ids=tuple(prompt), token_ids=tuple(sampled),
                            behavior_logprobs=tuple(-0.5 - k for k in range(n)), policy_versions=(version,) * n,
                            loss_mask=(1,) * n, finish_reason=finish, params=PARAMS)
    return CallRecord(index, fingerprint("chat", prompt, PARAMS), generation)


def test_a_call_that_extends_the_row_continues_it_with_the_new_prompt_forced():
    first = call(0, [1, 2, 3], [10, 11])
    second = call(1, [1, 2, 3, 10, 11, 5, 6], [12], version=1)

    segments, last = stitch([first, second])

    assert len(segments) == 1 and last == 0
    row = segments[0]
    assert row.request_id == "ep#0"
    assert row.prompt_ids == (1, 2, 3)
    assert row.token_ids == (10, 11, 5, 6, 12)
    assert row.loss_mask == (1, 1, 0, 0, 1)
    assert row.policy_versions == (0, 0, FORCED_VERSION, FORCED_VERSION, 1)
    assert row.behavior_logprobs == (-0.5, -1.5, 0.0, 0.0, -0.5)


def test_a_call_that_rewrites_the_history_opens_a_segment_and_the_last_call_picks_the_row():
    calls = [call(0, [1, 2], [10]), call(1, [1, 9], [11]),      # the agent rewrote its history: a new segment
             call(2, [1, 2, 10, 4], [12])]                      # back on the first line: it continues segment 0

    segments, last = stitch(calls)

    assert [s.prompt_ids for s in segments] == [(1, 2), (1, 9)]
    assert segments[0].token_ids == (10, 4, 12) and segments[1].token_ids == (11,)
    assert last == 0


def test_the_latest_segment_a_prompt_extends_wins_and_the_order_is_the_calls_index():
    calls = [call(2, [1, 2, 10, 7, 20, 8], [30]),                # arrived last, index 2
             call(0, [1, 2], [10]), call(1, [1, 2, 10, 7], [20])]

    segments, last = stitch(calls)

    assert len(segments) == 1 and segments[0].token_ids == (10, 7, 20, 8, 30) and last == 0


def test_a_call_with_nothing_sampled_is_left_out():
    segments, _ = stitch([call(0, [1, 2], [10]), call(1, [1, 2, 10, 3], [])])
    assert len(segments) == 1 and segments[0].token_ids == (10,)


def test_the_fingerprint_tells_prompts_and_sampling_apart():
    base = fingerprint("chat", [1, 2], PARAMS)
    assert base == fingerprint("chat", [1, 2], SamplingParams(max_new_tokens=8))
    assert base != fingerprint("chat", [1, 3], PARAMS)
    assert base != fingerprint("completions", [1, 2], PARAMS)
    assert base != fingerprint("chat", [1, 2], SamplingParams(max_new_tokens=8, seed=1))
