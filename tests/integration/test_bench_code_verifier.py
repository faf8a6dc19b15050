"""benchmarks/code_verifier.py: a --quick run scores every honest row of each kind with 1 and 2 workers."""

import json
from pathlib import Path

import pytest

from flashreinforce.sandbox import probe_isolation
from bench_script import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "code_verifier.py"


@pytest.mark.slow
def test_a_quick_run_times_every_kind_of_row(tmp_path):
    if probe_isolation() == "none":
        pytest.skip("no sandbox works here (apt-get install bubblewrap)")
    report = tmp_path / "report.json"
    # exits non-zero when an honest response does not score 1
    run_script(SCRIPT, "--quick", "--json", report, timeout=300)
    results = json.loads(report.read_text())["results"]
    assert {(r["kind"], r["workers"]) for r in results} == {(kind, workers) for kind in ("mbpp", "humaneval", "stdio")
                                                            for workers in (1, 2)}
    assert all(r["responses"] == 16 and len(r["seconds"]) == 1 and r["responses_per_second"] > 0 for r in results)
