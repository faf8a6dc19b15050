"""benchmarks/opd_smollm2.py: a --quick run (the arithmetic recipe's tiny model in place of SmolLM2) end to end,
checked through its JSON and its runs; run again, it reads its finished runs back instead of training them again."""

import json
from pathlib import Path

import pytest
from bench_script import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "opd_smollm2.py"


def _run(out: Path, json_path: Path) -> dict:
    done = run_script(SCRIPT, "--quick", "--seeds", "0", "1", "--eval-every", "2", "--out", out, "--json", json_path,
                      timeout=900)
    assert "| method | step | held-out mean |" in done.stdout
    return json.loads(json_path.read_text())


@pytest.mark.slow
def test_quick_run_trains_a_teacher_then_rl_and_opd_students_per_seed(tmp_path):
    report = _run(tmp_path, tmp_path / "first.json")
    assert [(run["method"], run["seed"]) for run in report["runs"]] == [("rl", 0), ("opd", 0), ("rl", 1), ("opd", 1)]
    for run in report["runs"]:
        evaluations = run["evaluations"]
        assert [e["step"] for e in evaluations] == [0, 2, 4]
        walls = [e["wall_seconds"] for e in evaluations]
        assert walls[0] == 0.0 and walls == sorted(walls) and run["wall_seconds"] >= walls[-1]
        rows = [json.loads(line) for line in (tmp_path / f"{run['method']}-seed{run['seed']}" / "metrics.jsonl")
                .read_text().splitlines()]
        kl = [row["loss/reverse_kl"] for row in rows if "loss/reverse_kl" in row]
        # opd trains on the teacher's signal (a teacher with a longer warm start: it differs), rl has none
        assert (len(kl) == 4 and all(value != 0.0 for value in kl)) if run["method"] == "opd" else not kl
    summary = json.loads((tmp_path / "opd-seed0" / "summary.json").read_text())
    assert summary["teachers"][""]["model"].startswith(str(tmp_path / "teacher" / "checkpoints"))
    # finished runs are read back, not trained again: the same report
    again = _run(tmp_path, tmp_path / "second.json")
    assert again["runs"] == report["runs"]
