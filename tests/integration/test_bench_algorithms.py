"""benchmarks/algorithms.py: a --quick run (every arm, one seed, two steps on SmolLM2) end to end, checked through
its JSON and its runs' configs. Two steps say nothing about which objective wins; what is asserted is the harness:
each arm trains what it says (its loss, prompts and rollouts a step), and the curves are read back from the runs."""

import json
from pathlib import Path

import pytest
import yaml

from flashreinforce.models import store
from bench_script import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "algorithms.py"
MODEL = "smollm2-135m-instruct"

pytestmark = [pytest.mark.slow, pytest.mark.reasoning_gym]


def test_quick_run_trains_every_arm_as_named_and_reads_its_curve_back(tmp_path):
    pytest.importorskip("reasoning_gym", reason="needs the reasoning-gym extra: pip install -e '.[reasoning-gym]'")
    cached = store.find(MODEL)
    if cached.problem is not None:
        pytest.skip(f"needs the converted model ({cached.path} {cached.problem}): run "
                    f"`flashreinforce models get {MODEL}`")
    out, report = tmp_path / "out", tmp_path / "algorithms.json"
    done = run_script(SCRIPT, "--quick", "--seeds", "0", "--out", out, "--json", report, timeout=900, cwd=SCRIPT.parent)
    runs = {run["arm"]: run for run in json.loads(report.read_text())["runs"]}
    assert set(runs) == {"fr", "grpo", "fr_half", "fr_filter"}
    per_step = {"fr": 4, "grpo": 4, "fr_half": 2, "fr_filter": 4}  # --quick's prompts x rollouts a step
    for name, run in runs.items():
        assert [point["step"] for point in run["points"]] == [0, 1, 2], name
        assert [point["rollouts"] for point in run["points"]] == [0, per_step[name], 2 * per_step[name]], name
        seconds = [point["train_seconds"] for point in run["points"]]
        assert seconds[0] == 0 < seconds[1] < seconds[2], name
        assert all(0 <= point["avg"] <= 100 and 0 <= point["greedy"] <= 100 for point in run["points"]), name
    configs = {name: yaml.safe_load((out / f"{name}-seed0" / "config.yaml").read_text()) for name in runs}
    assert configs["grpo"]["algo"]["loss"] == "grpo" and configs["grpo"]["scheduler"]["group_size"] == 4
    assert configs["grpo"]["algo"]["options"] == {}, "GRPO takes none of FlashREINFORCE's options"
    assert {configs[name]["algo"]["loss"] for name in ("fr", "fr_half", "fr_filter")} == {"flashreinforce"}
    assert configs["fr_filter"]["algo"]["options"]["negative_token_fraction"] == 0.2
    assert "negative_token_fraction" not in configs["fr"]["algo"]["options"]
    assert (out / "algorithms.png").stat().st_size > 0
    assert "| GRPO 8x4 | 0 |" in done.stdout
