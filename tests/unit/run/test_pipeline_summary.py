"""A pipeline's "before RL" is scored on the prompts its "after" is: the earliest stage over the last stage's tasks."""

from flashreinforce.run.stages import pipeline_start_score


def _sft(score: float, tasks: dict) -> dict:
    return {"stage": "warm", "kind": "sft", "final_accuracy": score, "tasks": tasks}


def _rl(name: str, before: float, after: float, tasks: dict) -> dict:
    return {"stage": name, "kind": "rl", "initial_accuracy": before, "final_accuracy": after, "tasks": tasks}


EVERY = {"sums": {}, "tool": {}, "game": {}}


def test_the_warm_start_over_every_task_is_the_start_of_a_pipeline_that_ends_on_every_task():
    summaries = [_sft(30.0, EVERY), _rl("reason", 40.0, 58.0, {"sums": {}}), _rl("all", 50.0, 66.0, EVERY)]
    assert pipeline_start_score(summaries) == 30.0  # not 40.0: the first RL stage scored arithmetic alone


def test_without_a_stage_over_the_same_tasks_the_last_stage_start_is_used():
    summaries = [_rl("reason", 40.0, 58.0, {"sums": {}}), _rl("all", 50.0, 66.0, EVERY)]
    assert pipeline_start_score(summaries) == 50.0


def test_a_one_task_pipeline_starts_after_its_warm_start():
    summaries = [{"stage": "warm", "kind": "sft", "final_accuracy": 45.0},
                 {"stage": "rl", "kind": "rl", "initial_accuracy": 45.5, "final_accuracy": 70.0}]
    assert pipeline_start_score(summaries) == 45.0
