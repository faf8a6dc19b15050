"""What the model reads back from a tool call that did not end normally."""

from dataclasses import replace

from flashreinforce.envs.python_tool import tool_output
from flashreinforce.sandbox.records import SandboxResult

DONE = SandboxResult(output="42\n", exit_code=0, timed_out=False, killed_by=None, over_memory=False, bytes_cut=0,
                     seconds=0.1, isolation="bwrap")


def test_a_normal_end_adds_no_note():
    assert tool_output(DONE) == "42"


def test_each_abnormal_end_is_named_once():
    killed = replace(DONE, exit_code=None, killed_by="SIGKILL")
    assert tool_output(replace(killed, timed_out=True)) == "42\n[timed out]"
    assert tool_output(replace(killed, over_memory=True)) == "42\n[killed: out of memory]"
    assert tool_output(killed) == "42\n[killed by SIGKILL]"
    assert tool_output(replace(DONE, exit_code=1, bytes_cut=7)) == "42\n[exit code 1, 7 bytes cut]"
