"""benchmarks/mopd.py: a --quick run of the ernie_mopd pipeline with its mixture stage, end to end, checked through
its JSON and the run it leaves (the figures of a quick run mean nothing; what is asserted holds by construction)."""

import json
from pathlib import Path

import pytest
from bench_script import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "mopd.py"
TASKS = ["sums", "tool", "follow", "most", "game"]


@pytest.mark.slow
def test_quick_run_distills_every_expert_and_compares_with_the_mixture(tmp_path):
    report_path = tmp_path / "mopd.json"
    done = run_script(SCRIPT, "--quick", "--out", tmp_path, "--json", report_path, timeout=900)
    assert "| task | warm start | its expert |" in done.stdout
    report = json.loads(report_path.read_text())
    assert [row["task"] for row in report["tasks"]] == TASKS
    for row in report["tasks"]:
        assert row["expert_stage"] == f"{row['task']}_expert"
        # the distill stage measured each teacher on the expert's own prompts with its sampling: the same score
        assert row["teacher"] == row["expert"]
        assert all(0.0 <= row[key] <= 100.0 for key in ("warm", "expert", "student", "mixture"))
    stages = {row["stage"]: row for row in report["stages"]}
    assert list(stages) == ["warm", *(f"{task}_expert" for task in TASKS), "merge", "mixture"]
    assert stages["merge"]["kind"] == "distill" and stages["mixture"]["steps"] == 5 * 2 + 3
    rows = [json.loads(line) for line in (Path(report["run_dir"]) / "stages" / "07-merge" / "metrics.jsonl")
            .read_text().splitlines()]
    trained = [row for row in rows if "loss/reverse_kl" in row]
    # each task's reverse KL at the steps whose batch (8 rows of 5 tasks) holds it; --quick runs in lockstep, so the
    # same batches every time
    assert len(trained) == 3
    assert {task for row in trained for task in TASKS if f"task/{task}/reverse_kl" in row} == set(TASKS)
