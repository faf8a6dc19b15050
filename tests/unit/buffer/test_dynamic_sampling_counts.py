"""The group filter's (DAPO dynamic sampling) kept and dropped groups, counted over the run and per task."""

import pickle

import pytest
from buffer_sim import drive, finished

from flashreinforce.buffer import build_scheduler
from flashreinforce.buffer.book import filter_metrics
from flashreinforce.types import Prompt

KINDS = [("sync", {}), ("april", {}), ("urb", {"buffer_size": 2}), ("stream", {"max_staleness": 1}),
         ("stream", {"max_staleness": 1, "stale_policy": "drop"})]


def mixture_at(position: int) -> Prompt:
    """Two tasks, a twice as often as b, the way a mixture's prompts carry their task."""
    task = "b" if position % 3 == 2 else "a"
    return Prompt(id=f"{task}/p{position}", prompt=f"question {position}", ground_truth="0", task=task)


class Recording:
    """DAPO's rule (rewards not all equal), remembering each verdict by task."""

    def __init__(self) -> None:
        self.verdicts: list[tuple[str, bool]] = []

    def __call__(self, group) -> bool:
        kept = len({t.reward for t in group}) > 1
        self.verdicts.append((group[0].prompt.task, kept))
        return kept


def test_filter_metrics_give_totals_and_each_named_tasks_counts():
    assert filter_metrics({}, {}) == {}
    assert filter_metrics({"": 3}, {"": 1}) == {"dynamic_sampling/kept_groups": 3,
                                                "dynamic_sampling/dropped_groups": 1}
    assert filter_metrics({"a": 2, "b": 1}, {"a": 4}) == {
        "dynamic_sampling/kept_groups": 3, "dynamic_sampling/dropped_groups": 4,
        "task/a/dynamic_sampling/kept_groups": 2, "task/a/dynamic_sampling/dropped_groups": 4,
        "task/b/dynamic_sampling/kept_groups": 1, "task/b/dynamic_sampling/dropped_groups": 0}


@pytest.mark.parametrize("kind, options", KINDS, ids=[f"{k}-{'-'.join(map(str, o.values()))}" for k, o in KINDS])
def test_every_scheduler_counts_each_filter_verdict_once_under_its_task(kind, options):
    for seed in range(4):
        record = Recording()
        scheduler = build_scheduler(kind, prompt_at=mixture_at, batch_groups=2, group_size=2, group_filter=record,
                                    **options)
        trace = drive(scheduler, steps=4, slots=4, seed=seed, preempt=0.1)
        stats = trace.scheduler.stats()
        for task in "ab":
            kept = sum(k for t, k in record.verdicts if t == task)
            dropped = sum(not k for t, k in record.verdicts if t == task)
            assert stats[f"task/{task}/dynamic_sampling/kept_groups"] == kept
            assert stats[f"task/{task}/dynamic_sampling/dropped_groups"] == dropped
            # a dropped group's rollouts are all in the ledger as filtered, under their task's prompt ids
            filtered = [key for key, reason in trace.scheduler.ledger.dropped().items() if reason == "filtered"]
            assert len([key for key in filtered if key.prompt_id.startswith(f"{task}/")]) == 2 * dropped
        assert stats["dynamic_sampling/kept_groups"] == sum(k for _, k in record.verdicts)
        assert stats["dynamic_sampling/dropped_groups"] == sum(not k for _, k in record.verdicts) > 0


def test_the_counts_survive_a_checkpoint_and_an_older_checkpoint_restarts_them():
    scheduler = build_scheduler("sync", prompt_at=mixture_at, batch_groups=2, group_size=2, group_filter=Recording())
    for _ in range(2):  # a: p0 kept (rewards 0, 1), p1 dropped; b: p2 dropped (its rewards all 1)
        for task in scheduler.admit(free_slots=4, version=0):
            scheduler.on_finished(finished(task, reward=float(task.key.sample if task.group == 0 else 1)))
    before = scheduler.stats()
    assert before["task/a/dynamic_sampling/kept_groups"] == 1 and before["task/a/dynamic_sampling/dropped_groups"] == 1
    assert before["task/b/dynamic_sampling/dropped_groups"] == 1 and before["dynamic_sampling/dropped_groups"] == 2
    state = pickle.loads(pickle.dumps(scheduler.state_dict()))
    restored = build_scheduler("sync", prompt_at=mixture_at, batch_groups=2, group_size=2, group_filter=Recording())
    restored.load_state_dict(state)
    assert restored.stats() == before
    del state["book"]["filter_counts"]
    old = build_scheduler("sync", prompt_at=mixture_at, batch_groups=2, group_size=2, group_filter=Recording())
    old.load_state_dict(state)
    assert not [k for k in old.stats() if "dynamic_sampling" in k]


def test_one_task_gets_the_totals_only_and_no_filter_gets_nothing():
    def plain_at(position: int) -> Prompt:
        return Prompt(id=f"p{position}", prompt="q", ground_truth="0")

    for group_filter, expected in ((Recording(), {"dynamic_sampling/kept_groups", "dynamic_sampling/dropped_groups"}),
                                   (None, set())):
        scheduler = build_scheduler("sync", prompt_at=plain_at, batch_groups=1, group_size=2, group_filter=group_filter)
        for task in scheduler.admit(free_slots=2, version=0):
            scheduler.on_finished(finished(task, reward=float(task.key.sample)))
        names = {k for k in scheduler.stats() if "dynamic_sampling" in k or k.startswith("task/")}
        assert names == expected
