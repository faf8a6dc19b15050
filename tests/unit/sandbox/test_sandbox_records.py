"""SandboxLimits refuses limits that could not hold; SandboxResult.status() is the CLI's JSON line."""

import json

import pytest

from flashreinforce.sandbox import SandboxLimits, SandboxResult
from flashreinforce.sandbox.records import HARD_OUTPUT_BYTES


@pytest.mark.parametrize("field", ["wall_s", "cpu_s", "memory_mb", "output_bytes", "file_mb", "max_files", "nproc"])
def test_every_limit_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        SandboxLimits(**{field: 0})


def test_output_cap_has_a_hard_ceiling_whatever_the_config():
    with pytest.raises(ValueError, match="hard cap"):
        SandboxLimits(output_bytes=HARD_OUTPUT_BYTES + 1)
    assert SandboxLimits(output_bytes=HARD_OUTPUT_BYTES).output_bytes == HARD_OUTPUT_BYTES


def test_status_is_the_json_line_without_the_output():
    result = SandboxResult(output="secret-ish output\n", exit_code=None, timed_out=True, killed_by="SIGKILL",
                           over_memory=False, bytes_cut=7, seconds=0.123456, isolation="bwrap")
    status = json.loads(json.dumps(result.status()))
    assert status == {"isolation": "bwrap", "exit_code": None, "timed_out": True, "killed_by": "SIGKILL",
                      "over_memory": False, "bytes_cut": 7, "seconds": 0.1235}


def test_kernel_limits_must_be_whole_numbers():
    with pytest.raises(ValueError, match="cpu_s must be a positive whole number"):
        SandboxLimits(cpu_s=2.5)
    assert SandboxLimits(wall_s=0.25).wall_s == 0.25
