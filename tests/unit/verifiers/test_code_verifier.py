"""The code verifier: programs against assert and stdin/stdout tests in the sandbox, its ground truths and its
options; and containment: every hostile program of the sandbox's attack tests (tests/sandbox_attacks.py),
submitted as a response, ends in a failed Verdict with a reason, leaks nothing, and the next call still works.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time

import pytest
import sandbox_attacks as attacks
from sandbox_attacks import needs_bwrap, needs_unshare

from flashreinforce.sandbox import probe_isolation
from flashreinforce.types import Prompt
from flashreinforce.verifiers import code as code_module
from flashreinforce.verifiers.code import (
    check_ground_truth,
    code_verifier,
    extract_program,
    parse_ground_truth,
)
from flashreinforce.verifiers.pool import VerifierPool
from flashreinforce.verifiers.registry import parse_spec, spec_ref
from flashreinforce.verifiers.rewards import load_reward_fn


PROMPT = Prompt(id="p", prompt="Write add(a, b).", ground_truth="")
ADD_TESTS = json.dumps(["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"])
SUM_PAIRS = json.dumps([{"input": "1 2\n", "output": "3\n"}, {"input": "-1 1\n", "output": "0\n"},
                        {"input": "2 2\n", "output": "4\n"}])
ADD = "def add(a, b):\n    return a + b"
SUM = "a, b = map(int, input().split())\nprint(a + b)"
ESCAPED = json.dumps([{"input": "", "output": "ESCAPED"}])
"""For the attacks that print what they reached: only an escape could print what this expects."""


def fenced(program: str, language: str = "python") -> str:
    return f"Here is my solution.\n```{language}\n{program}\n```\nIt adds them."


@pytest.fixture(scope="module")
def score():
    """The verifier with short deadlines, at the strongest isolation here (skipped where there is none)."""
    if probe_isolation() == "none":
        pytest.skip("no sandbox works here (apt-get install bubblewrap)")
    return code_verifier(test_timeout_s=0.5, time_budget_s=3.0)


# ---- the program -------------------------------------------------------------------------------------------

def test_the_program_is_the_last_complete_python_block_after_the_think():
    assert extract_program(fenced("print(1)") + fenced("print(2)", "")) == "print(2)"
    assert extract_program(fenced("print(1)") + fenced("echo 2", "bash")) == "print(1)"  # not Python
    assert extract_program("~~~py\nprint(3)\n~~~") == "print(3)"
    assert extract_program("  ```python\n  if x:\n      y()\n  ```") == "if x:\n    y()"  # an indented block
    assert extract_program("<think>```python\nprint(1)\n```</think>" + fenced("print(2)")) == "print(2)"
    assert extract_program("<think>```python\nprint(1)\n```</think>no code") is None
    assert extract_program("<think>```python\nprint(1)\n```") is None  # the think never closed
    assert extract_program(fenced("print(1)") + "```python\nprint(2)") == "print(1)"  # cut off inside a block
    assert extract_program("print(1)") is None
    assert extract_program("```python\n\n```") is None


def test_a_response_without_a_program_scores_0_with_reason_no_code(score):
    verdict = score("The answer is add = lambda a, b: a + b", ADD_TESTS, PROMPT)
    assert (verdict.reward, verdict.passed, verdict.reason) == (0.0, False, "no_code")


# ---- the ground truth --------------------------------------------------------------------------------------

def test_the_three_ground_truth_shapes():
    asserts = parse_ground_truth(ADD_TESTS)
    assert (asserts.kind, len(asserts.tests)) == ("asserts", 3)
    pairs = parse_ground_truth(SUM_PAIRS)
    assert (pairs.kind, pairs.tests[0], pairs.expected[0]) == ("io", "1 2\n", "3\n")
    apps = parse_ground_truth(json.dumps({"inputs": ["1 2\n", "2 2\n"], "outputs": ["3\n", "4\n"]}))
    assert (apps.kind, apps.tests, apps.expected) == ("io", ("1 2\n", "2 2\n"), ("3\n", "4\n"))


@pytest.mark.parametrize(("ground_truth", "message"), [
    ("assert add(1, 2) == 3", r"not JSON .*give a JSON list of assert statements"),
    ("[]", "has no tests"),
    ('{"inputs": [], "outputs": []}', "has no tests"),
    ('"assert True"', "is a JSON string, not a list of tests"),
    ('["assert True", {"input": "", "output": ""}]', "objects and strings: all strings .* not a mix"),
    ('[{"input": "1", "expected": "2"}]', r"test 1 is .*\{\"input\": \"TEXT\", \"output\": \"TEXT\"\}"),
    ('[{"input": "1", "output": 2}]', "both strings"),
    ('["assert add(1, 2) == "]', r"test 1 is not valid Python"),
    ('["   "]', "test 1 is empty"),
    ('{"inputs": ["[1, 2]"], "outputs": ["3"], "fn_name": "add"}', r"call-based tests \(fn_name\) are not supported"),
    ('{"inputs": ["1"], "outputs": ["2", "3"]}', "lists of the same length"),
    ('{"asserts": ["assert True"]}', "exactly `inputs` and `outputs`"),
])
def test_a_ground_truth_of_no_accepted_shape_is_an_error_naming_it(ground_truth, message):
    with pytest.raises(ValueError, match=message):
        check_ground_truth(ground_truth)


def test_a_bad_ground_truth_at_call_time_raises_for_the_pool_to_report(score):
    with pytest.raises(ValueError, match="has no tests"):
        score(fenced(ADD), "[]", PROMPT)


# ---- scoring -------------------------------------------------------------------------------------------------

def test_asserts_score_the_fraction_passed_and_name_the_first_failure(score):
    assert score(fenced(ADD), ADD_TESTS, PROMPT).reason == "ok"
    partly = score(fenced("def add(a, b):\n    return abs(a) + b"), ADD_TESTS, PROMPT)
    assert (partly.reward, partly.passed, partly.reason) == (pytest.approx(2 / 3), False,
                                                             "failed: test 2: AssertionError")
    wrong = score(fenced("def add(a, b):\n    return a - b"), ADD_TESTS, PROMPT)
    assert (wrong.reward, wrong.reason) == (0.0, "failed: test 1: AssertionError")
    raising = score(fenced("def add(a, b):\n    return a + c"), ADD_TESTS, PROMPT)
    assert raising.reason == "failed: test 1: NameError: name 'c' is not defined"


def test_stdin_stdout_tests_compare_lines_without_trailing_whitespace(score):
    assert score(fenced(SUM), SUM_PAIRS, PROMPT).passed
    for program in ("import sys\na, b = map(int, sys.stdin.buffer.read().split())\nsys.stdout.write(f'{a+b}  \\r\\n\\n')",
                    "a, b = map(int, open(0).read().split())\nprint(a + b)\nraise SystemExit",
                    "import os, sys\nprint(sum(map(int, input().split())))\nsys.stdout.flush()\nos._exit(0)"):
        assert score(fenced(program), SUM_PAIRS, PROMPT).passed, program
    indented = score(fenced("print(' ' + str(sum(map(int, input().split()))))"), SUM_PAIRS, PROMPT)
    assert indented.reason == "failed: test 1: wrong output"  # leading whitespace counts
    partly = score(fenced("a, b = map(int, input().split())\nprint(abs(a) + b)"), SUM_PAIRS, PROMPT)
    assert (partly.reward, partly.reason) == (pytest.approx(2 / 3), "failed: test 2: wrong output")
    crashing = score(fenced("a, b = map(int, input().split())\nprint(a + b + 0 // (a + b))"), SUM_PAIRS, PROMPT)
    assert (crashing.reward, crashing.reason) == (pytest.approx(2 / 3),
                                                  "failed: test 2: ZeroDivisionError: integer division or modulo by zero")
    exiting = score(fenced("import sys\nprint(3)\nsys.exit(2)"), SUM_PAIRS, PROMPT)
    assert exiting.reason == "failed: test 1: exited (SystemExit: 2)"


def test_all_pass_scores_1_or_0(score):
    strict = code_verifier(all_pass=True, test_timeout_s=0.5, time_budget_s=3.0)
    assert strict(fenced(ADD), ADD_TESTS, PROMPT).reward == 1.0
    partly = strict(fenced("def add(a, b):\n    return abs(a) + b"), ADD_TESTS, PROMPT)
    assert (partly.reward, partly.passed, partly.reason) == (0.0, False, "failed: test 2: AssertionError")


def test_a_program_that_does_not_compile_or_run_fails_every_test_once(score):
    syntax = score(fenced("def add(a, b)\n    return a + b"), ADD_TESTS, PROMPT)
    assert (syntax.reward, syntax.reason) == (0.0, "failed: program: SyntaxError: expected ':' (line 1)")
    assert score(fenced("def add(a, b)\n    return a + b"), SUM_PAIRS, PROMPT).reason == syntax.reason
    assert score(fenced("1 / 0"), ADD_TESTS, PROMPT).reason == \
        "failed: program: ZeroDivisionError: division by zero"
    # exit(0) before the tests is no pass, whether as SystemExit or straight from the process
    assert score(fenced("import sys\nsys.exit(0)"), ADD_TESTS, PROMPT).reason == \
        "failed: program: exited before the tests ran (SystemExit: 0)"
    assert score(fenced("import os\nos._exit(0)"), ADD_TESTS, PROMPT).reason == \
        "failed: program: exited before the tests ran (exit code 0)"


def test_a_test_that_hangs_or_kills_its_process_fails_alone():
    score = code_verifier(test_timeout_s=0.4, time_budget_s=3.0)
    hangs = "def add(a, b):\n    while a < 0:\n        pass\n    return a + b"
    for ground_truth, program in ((ADD_TESTS, hangs), (SUM_PAIRS, f"{hangs}\n{SUM.replace('a + b', 'add(a, b)')}")):
        start = time.monotonic()
        verdict = score(fenced(program), ground_truth, PROMPT)
        assert (verdict.reward, verdict.reason) == (pytest.approx(2 / 3), "failed: test 2: timeout"), ground_truth
        assert time.monotonic() - start < 0.4 + 1.0  # one test's deadline, then the others at once
    killed = score(fenced("import os\ndef add(a, b):\n    if a < 0:\n        os.kill(os.getpid(), 9)\n    return a + b"),
                   ADD_TESTS, PROMPT)
    assert (killed.reward, killed.reason) == (pytest.approx(2 / 3), "failed: test 2: killed by SIGKILL")


def test_tests_past_the_time_budget_fail_naming_it(score):
    submit = _spying(code_verifier(test_timeout_s=0.3, time_budget_s=0.5))
    hangs = json.dumps(["while True:\n    pass"] * 4 + ["assert True"])
    verdict, results, seconds = submit("pass", hangs)
    assert seconds < 0.5 + 0.5
    assert (verdict.reward, verdict.reason) == (0.0, "failed: test 1: timeout")  # the last test was never reached
    assert [r.why for r in results] == ["timeout", "timeout (the time budget of 0.5 s ran out)",
                                        *["not run (the time budget of 0.5 s ran out)"] * 3]


# ---- options and the paths to it --------------------------------------------------------------------------------

@pytest.mark.parametrize(("options", "message"), [
    ({"language": "cpp"}, "language 'cpp' is not supported"),
    ({"test_timeout_s": 5.0, "time_budget_s": 4.0}, "need 0 < test_timeout_s <= time_budget_s"),
    ({"test_timeout_s": "1"}, "need 0 < test_timeout_s"),
    ({"output_bytes": 1 << 20}, "output_bytes=1048576: a whole number of bytes from 1 to 524288"),
    ({"memory_mb": 32}, "memory_mb=32: a Python process needs at least 64 MiB"),
    ({"isolation": "docker"}, "isolation must be"),
    ({"isolation": "none"}, r"opt in with .*\{kind: code, allow_unisolated: true\}"),
])
def test_bad_options_are_errors_naming_them(options, message):
    with pytest.raises(ValueError, match=message):
        code_verifier(**options)


def test_unisolated_runs_only_with_the_opt_in():
    unisolated = code_verifier(isolation="none", allow_unisolated=True, test_timeout_s=0.5)
    assert unisolated(fenced(ADD), ADD_TESTS, PROMPT).passed


def test_the_registry_builds_it_from_a_spec_as_the_pools_workers_do(score):
    ref = spec_ref(parse_spec({"kind": "code", "all_pass": True, "test_timeout_s": 0.5}))
    verifier = load_reward_fn(ref)
    assert verifier(fenced(ADD), ADD_TESTS, PROMPT).passed
    assert verifier(fenced("def add(a, b):\n    return 3"), ADD_TESTS, PROMPT).reward == 0.0


def test_one_call_through_a_real_verifier_pool(score):
    ref = spec_ref(parse_spec({"kind": "code", "test_timeout_s": 0.5}))
    with VerifierPool([ref], timeout_s=5.0, max_workers=1) as pool:
        prompt = Prompt(id="q", prompt="Add two numbers from stdin.", ground_truth=SUM_PAIRS, data_source="code")
        verdict = pool.score_sync(fenced(SUM), prompt)
        bad = pool.score_sync(fenced(SUM), Prompt(id="r", prompt="x", ground_truth="[]"))
    assert (verdict.reward, verdict.reason) == (1.0, "ok")
    assert bad.reason.startswith("error: ValueError: code: the ground truth has no tests")


# ---- containment ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hostile():
    """The verifier at the bwrap level, as the sandbox's attack tests run: (verdict, its test results)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bwrap is not installed (apt-get install bubblewrap)")
    verifier = code_verifier(isolation="bwrap", test_timeout_s=0.3, time_budget_s=3.0)
    return _spying(verifier)


def _spying(verifier):
    def submit(program: str, ground_truth: str = ESCAPED):
        seen = []
        real = code_module.run_tests

        def spy(*args):
            seen.extend(real(*args))
            return seen
        code_module.run_tests = spy
        try:
            start = time.monotonic()
            verdict = verifier(fenced(program), ground_truth, PROMPT)
        finally:
            code_module.run_tests = real
        assert not verdict.passed and verdict.reason.startswith("failed: "), verdict
        assert verifier(fenced(ADD), ADD_TESTS, PROMPT).passed  # the run goes on: the next call works
        return verdict, seen, time.monotonic() - start
    return submit


def test_an_infinite_loop_is_stopped_at_the_deadline(hostile):
    verdict, _, seconds = hostile(attacks.INFINITE_LOOP, ADD_TESTS)
    assert verdict.reason == "failed: program: timeout" and seconds < 0.3 + 1.0


@pytest.mark.slow
def test_a_busy_loop_is_stopped_by_the_wall_or_the_cpu_deadline(hostile):
    verdict, _, seconds = hostile(attacks.BUSY_LOOP, ADD_TESTS)
    assert verdict.reason in ("failed: program: timeout", "failed: program: timeout (CPU)")
    assert seconds < 0.3 + 1.0


def test_a_fork_bomb_is_stopped_and_leaves_nothing_behind(hostile):
    verdict, _, seconds = hostile(attacks.FORK_BOMB, ADD_TESTS)
    assert verdict.reason == "failed: program: timeout" and seconds < 0.3 + 1.0
    _, results, _ = hostile(attacks.COUNT_PROCESSES)
    assert results[0].output == "1\n"  # only itself: the harness is hidden, the bomb is gone


def test_the_process_limit_holds(hostile):
    verdict, results, seconds = hostile(attacks.SLEEPING_FORKS, json.dumps([{"input": "", "output": "200"}]))
    assert verdict.reason == "failed: test 1: wrong output"
    assert int(results[0].output) == 16 - 2  # nproc, less the harness and the test's own process
    assert seconds < 2  # the sleepers were killed when the test ended, not waited for


def test_a_memory_bomb_fails_with_memory_error(hostile):
    assert hostile(attacks.MEMORY_BOMB, ADD_TESTS)[0].reason == "failed: program: MemoryError"


@pytest.mark.slow  # 900 MiB allocated
def test_processes_together_cannot_exceed_the_memory_limit():
    if shutil.which("bwrap") is None:
        pytest.skip("bwrap is not installed (apt-get install bubblewrap)")
    submit = _spying(code_verifier(isolation="bwrap", test_timeout_s=3.0, time_budget_s=4.0))
    verdict, _, seconds = submit(attacks.MEMORY_TOGETHER, ADD_TESTS)
    assert verdict.reason == "failed: test 1: the call ended (out of memory)"
    assert seconds < 3  # killed when their sum went over, not at the deadline


def test_huge_output_is_cut_at_the_cap(hostile):
    verdict, results, _ = hostile(attacks.HUGE_OUTPUT, json.dumps([{"input": "", "output": "x"}]))
    assert verdict.reason == "failed: test 1: output over 65536 bytes"
    assert results[0].output == "x" * 65536


def test_writing_outside_scratch_fails_and_the_host_file_is_not_created(hostile, tmp_path):
    target = tmp_path / "escaped.txt"
    verdict, results, _ = hostile(attacks.write_outside(str(target)))
    assert verdict.reason == "failed: test 1: wrong output"
    assert "WROTE" not in results[0].output and len(results[0].output.splitlines()) == 5
    assert not target.exists()


def test_a_loopback_listener_in_the_parent_is_unreachable(hostile):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        _verdict, results, _ = hostile(attacks.connect_loopback(port))
        listener.settimeout(0.1)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert results[0].output.startswith("PermissionError\n") and f":{port:04X}" not in results[0].output


@needs_bwrap
def test_secrets_in_the_environment_and_in_files_outside_are_not_readable(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHREINFORCE_TEST_SECRET", "hunter2")
    monkeypatch.setattr(code_module, "_SANDBOXES", {})  # a sandbox started after the secret was set
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    submit = _spying(code_verifier(isolation="bwrap", test_timeout_s=0.5))
    verdict, results, _ = submit(attacks.read_secrets(str(secret)), json.dumps([{"input": "", "output": "hunter2"}]))
    assert verdict.reason == "failed: test 1: wrong output"
    assert "hunter2" not in results[0].output
    assert results[0].output.splitlines()[0] == "['HOME', 'LANG', 'PATH', 'PWD']"


def test_killing_the_parents_from_inside_ends_only_its_own_call(hostile):
    sandbox = code_module.shared_sandbox(code_module.sandbox_limits(3.0, 512), "bwrap", False)
    worker = sandbox._worker.process.pid
    verdict, _, _ = hostile(attacks.kill_parents(os.getpid(), worker), ADD_TESTS)
    # Its parent is the harness, which it may kill: that call ends, the verifier goes on.
    assert verdict.reason == "failed: test 1: the call ended (killed by SIGKILL)"
    os.kill(os.getpid(), 0)  # we are alive
    assert sandbox._worker.process.pid == worker  # the same warm worker


def test_rejoining_or_making_namespaces_fails(hostile):
    _, results, _ = hostile(attacks.REJOIN_NAMESPACES)
    lines = results[0].output.splitlines()
    assert len(lines) == 9 and all(line.endswith((" open 2", " -1 1")) for line in lines), lines


def test_deep_recursion_is_contained(hostile):
    assert hostile(attacks.DEEP_RECURSION, ADD_TESTS)[0].reason == \
        "failed: program: RecursionError: maximum recursion depth exceeded"
    verdict, _, seconds = hostile(attacks.UNBOUNDED_RECURSION, ADD_TESTS)
    assert verdict.reason.startswith("failed: program: ") and seconds < 0.3 + 1.0


def test_a_program_near_the_memory_limit_fails_with_its_own_memory_error(hostile):
    # 490 MiB is under the per-process limit (512) but not beside the harness: the program's MemoryError, named,
    # never the call's end by the sandbox's guard (which would fail the tests after it too).
    verdict, _, _ = hostile("b = b'1' * (490 << 20)", ADD_TESTS)
    assert verdict.reason == "failed: program: MemoryError"


def test_a_dead_sandbox_worker_is_replaced(hostile):
    sandbox = code_module.shared_sandbox(code_module.sandbox_limits(3.0, 512), "bwrap", False)
    first = sandbox._worker.process.pid
    sandbox._worker.kill()
    assert hostile(attacks.SELF_SIGSEGV, ADD_TESTS)[0].reason == "failed: program: killed by SIGSEGV"
    assert sandbox._worker.process.pid != first


def test_signals_name_the_ending(hostile):
    assert hostile(attacks.SELF_SIGSEGV, ADD_TESTS)[0].reason == "failed: program: killed by SIGSEGV"


def test_calls_share_no_state_and_kernel_objects_and_limits_hold(hostile):
    assert hostile(attacks.LEAVE_STATE)[1][0].output == "/scratch\n"
    assert hostile(attacks.SEE_STATE)[1][0].output == "[] [] [] None\n"
    assert hostile(attacks.KERNEL_OBJECTS)[1][0].output == "True\nshmget -1 1\nmq_open -1 1\nabstract socket 1\n"
    assert hostile(attacks.RAISE_LIMITS)[1][0].output == "refused\n" * 4


@needs_unshare
def test_where_bubblewrap_is_missing_unshare_contains_the_same(tmp_path):
    submit = _spying(code_verifier(isolation="unshare", test_timeout_s=0.5))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        _, results, _ = submit(attacks.connect_loopback(listener.getsockname()[1]))
    assert results[0].output.startswith("PermissionError\n")
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    _, results, _ = submit(attacks.read_and_write_outside(str(secret), str(tmp_path / "escaped")))
    assert "hunter2" not in results[0].output and "WROTE" not in results[0].output
    assert not (tmp_path / "escaped").exists()
    _, results, _ = submit(attacks.SLEEPING_FORKS)
    assert int(results[0].output) == 16 - 2


def test_attacks_on_the_harness_itself_fail_the_response(hostile):
    # SIGINT to its parent: the harness ignores it and the tests run (the program defines no add: they fail)
    interrupt = "import os, signal\nos.kill(os.getppid(), signal.SIGINT)"
    assert hostile(interrupt, ADD_TESTS)[0].reason == "failed: test 1: NameError: name 'add' is not defined"
    # passes claimed on the report pipe before the tests ran are not heard
    forged = "import os\nfor i in range(3):\n    os.write(3, ('{\"done\": %d, \"ok\": true}\\n' % i).encode())\nos._exit(0)"
    assert hostile(forged, ADD_TESTS)[0].reason == "failed: program: exited before the tests ran (exit code 0)"


@needs_bwrap
@pytest.mark.slow  # runs to its time budget
def test_a_program_that_stops_its_harness_is_ended_by_the_time_budget():
    submit = _spying(code_verifier(isolation="bwrap", test_timeout_s=0.5, time_budget_s=1.0))
    verdict, _, seconds = submit("import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)", ADD_TESTS)
    assert verdict.reason == "failed: test 1: the call ended (timeout)"
    assert seconds < 1.0 + code_module.WALL_SLACK_S + 1.0
