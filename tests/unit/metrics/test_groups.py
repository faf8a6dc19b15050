"""Metrics per task and per modality of a trained batch (metrics/groups.py), and the console's worst task."""

from dataclasses import replace

from flashreinforce.metrics.console import hacking, watch_summary, worst_task
from flashreinforce.metrics.groups import group_metrics
from flashreinforce.types import EpisodeState, FORCED_VERSION, Prompt, RolloutKey, Trajectory, Verdict


def row(task="", modality="text", reward=1.0, finish="stop", version=2, episode=None, parts=(), signs=()):
    return Trajectory(key=RolloutKey(f"{task}/p", 0), prompt=Prompt(f"{task}/p", "x", "1", task=task, modality=modality),
                      group=0, tokens=(1, 2, 3, 4), loss_mask=(0, 1, 1, 1), behavior_logprobs=(0.0, -1.0, -1.0, -1.0),
                      policy_versions=(FORCED_VERSION, version, version, version), prompt_length=1,
                      finish_reason=finish, verdict=Verdict(reward=reward, passed=reward > 0, parts=parts, signs=signs),
                      episode=episode)


def test_a_mixture_reports_each_task_and_a_one_task_batch_no_groups():
    batch = [row("sums", reward=1.0), row("sums", reward=0.0, finish="length"),
             row("game", reward=0.0, version=1, episode=replace(EpisodeState(seed=0), actions=("a", "b"), tool_calls=1))]
    metrics = group_metrics(batch, version=4)  # trained at step 3: lags 1 (version 2) and 2 (version 1)
    assert metrics["task/sums/rows"] == 2 and metrics["task/sums/reward_mean"] == 0.5
    assert metrics["task/sums/pass_rate"] == 0.5 and metrics["task/sums/truncated_fraction"] == 0.5
    assert metrics["task/sums/lag_mean"] == 1 and metrics["task/game/lag_mean"] == 2
    assert metrics["task/game/turns"] == 2 and metrics["task/game/tool_calls"] == 1 and "task/sums/turns" not in metrics
    assert metrics["task/sums/response_length"] == 3
    assert not any(key.startswith("modality/") for key in metrics)  # one modality: the totals say it
    assert group_metrics([row(), row(reward=0.0)], version=1) == {}


def test_modalities_and_a_sums_parts_are_reported_too():
    batch = [row("a", "text", parts=(("math", 1.0), ("format", 0.0))), row("a", "image", reward=0.0,
                                                                           parts=(("math", 0.0), ("format", 1.0)))]
    metrics = group_metrics(batch, version=3)
    assert metrics["modality/image/reward_mean"] == 0.0 and metrics["modality/text/reward_mean"] == 1.0
    assert metrics["verifier/part/math"] == 0.5 and metrics["task/a/verifier/format"] == 0.5


def test_the_console_names_the_worst_task_of_a_mixture_only():
    assert worst_task({"task/sums/reward_mean": 0.8, "task/game/reward_mean": 0.25}) == " (worst: game 0.250)"
    assert worst_task({"task/sums/reward_mean": 0.8, "reward/mean": 0.8}) == ""


def test_the_hacking_watch_reports_the_share_of_rows_and_of_rewarded_rows_with_each_sign():
    batch = [row("code", reward=0.0, signs=("exited_early",)), row("code", reward=0.0, signs=("not_plain",)),
             row("code", reward=1.0, signs=("unverified_asserts",)), row("code", reward=1.0),
             row("sums", reward=1.0)]
    metrics = group_metrics(batch, version=3)
    assert metrics["hacking/exited_early"] == metrics["hacking/not_plain"] == 0.2
    assert metrics["hacking/any"] == 0.6 and metrics["hacking/base_exception"] == 0.0
    # three rewarded rows, one of them on the program's word alone
    assert metrics["hacking/rewarded/unverified_asserts"] == metrics["hacking/rewarded/any"] == 1 / 3
    assert metrics["hacking/rewarded/exited_early"] == 0.0
    assert metrics["task/code/hacking/any"] == 0.75 and metrics["task/code/hacking/rewarded/any"] == 0.5
    assert not any(key.startswith("task/sums/hacking/") for key in metrics)  # no sign there: no keys
    assert not any(key.startswith("hacking/") for key in group_metrics([row(), row(reward=0.0)], version=1))
    unrewarded = group_metrics([row(reward=0.0, signs=("exited_early",))], version=1)
    assert unrewarded["hacking/exited_early"] == 1.0 and unrewarded["hacking/rewarded/exited_early"] == 0.0


def test_the_console_shows_the_hacking_watch_when_it_sees_a_sign():
    assert hacking({"hacking/any": 0.25, "hacking/rewarded/any": 0.0}) == "  hacking signs 25% (rewarded 0%)"
    assert hacking({"reward/mean": 1.0}) == ""
    assert watch_summary({"calls": 96, "exited_early": 12, "not_plain": 3, "reason/ok": 80}) == \
        "exited_early 12, not_plain 3 of 96 scored"
    assert watch_summary({"calls": 96, "reason/ok": 96}) is None
