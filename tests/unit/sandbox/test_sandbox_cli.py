"""`flashreinforce sandbox FILE.py`: the observation, then one JSON line; exit 0 whatever the code did."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # ~5 s: `flashreinforce.run` imports torch on its way to run/sandbox.py
def test_the_command_prints_the_output_then_a_json_status(tmp_path):
    script = tmp_path / "attempt.py"
    script.write_text("import os\nprint('hello from', os.getcwd())\nraise SystemExit(3)")
    done = subprocess.run([sys.executable, "-m", "flashreinforce", "sandbox", str(script), "--timeout", "2",
                           "--memory-mb", "256"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    *output, status = done.stdout.splitlines()
    assert output == ["hello from /scratch"]
    status = json.loads(status)
    assert set(status) == {"isolation", "exit_code", "timed_out", "killed_by", "over_memory", "bytes_cut",
                           "seconds"}
    assert (status["exit_code"], status["timed_out"], status["killed_by"], status["bytes_cut"]) == (3, False, None, 0)
    assert f"isolation {status['isolation']}" in done.stderr
