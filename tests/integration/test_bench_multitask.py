"""benchmarks/multitask.py: a --quick run end to end (the multitask recipe, then each task alone), checked through
its JSON, its run directories and its printed table.

A quick run's accuracies are near chance, so no gain is compared. What is asserted holds by construction: one
mixture row and one alone row for each task of the recipe; the mixture's rows come from one run (the same steps and
wall time); under --budget rows an alone run takes max(1, round(steps x its share of the weights)) optimizer steps;
and each alone run starts from the mixture's SFT checkpoint and scores the same held-out prompts (each task's data
seeded by its own settings, every evaluation sample by its prompt id and index), so its accuracy before RL is the
mixture's.
"""

import json
from pathlib import Path

import pytest

from flashreinforce.config import load_config
from bench_script import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "multitask.py"


@pytest.mark.slow
def test_quick_run_scores_each_task_in_the_mixture_and_alone_from_the_same_start(tmp_path):
    out, json_path = tmp_path / "out", tmp_path / "multitask.json"
    done = run_script(SCRIPT, "--quick", "--out", out, "--json", json_path, timeout=300, cwd=tmp_path)
    report = json.loads(json_path.read_text())
    assert report["budget"] == "rows" and {"cores", "load_average", "busy"} <= set(report["machine"])
    recipe = load_config("multitask")
    weights = {name: task.weight for name, task in recipe.task_list()}
    rows = {(row["run"], row["task"]): row for row in report["rows"]}
    assert len(report["rows"]) == 2 * len(weights) and set(rows) == {(run, task) for run in ("mixture", "alone")
                                                                    for task in weights}

    mixture = [rows["mixture", task] for task in weights]
    steps = mixture[0]["steps"]
    assert steps > 0 and all(row["steps"] == steps for row in mixture)
    assert mixture[0]["wall_seconds"] > 0 and all(row["wall_seconds"] == mixture[0]["wall_seconds"] for row in mixture)
    for task, weight in weights.items():
        alone = rows["alone", task]
        assert alone["steps"] == max(1, round(steps * weight / sum(weights.values()))), (task, alone)
        assert alone["wall_seconds"] > 0, task
        assert alone["before"] == rows["mixture", task]["before"], (task, alone, rows["mixture", task])
        for row in (alone, rows["mixture", task]):
            assert 0 <= row["before"] <= 100 and 0 <= row["after"] <= 100, row

    assert (out / recipe.name / "sft").is_dir()  # the alone runs' warm start
    assert all((out / f"{recipe.name}-{task}-alone").is_dir() for task in weights)
    table = [line for line in done.stdout.splitlines() if line.startswith("| ") and (" | mixture | " in line
                                                                                   or " | alone | " in line)]
    assert len(table) == 2 * len(weights), done.stdout
