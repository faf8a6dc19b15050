"""The `code` verifier: the response's program runs against the row's unit tests in the sandbox.

The program is the last complete fenced code block (```python, ```py or a bare ```) of what follows the last
`</think>` (a `<think>` that never closes has no program). The row's ground truth is a JSON string, one of:

    ["assert add(1, 2) == 3", ...]                          assert tests (MBPP's test_list; a HumanEval check
                                                            function called on the entry point)
    [{"input": "1 2\\n", "output": "3\\n"}, ...]              stdin/stdout tests: the program reads the input
    {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}     the same, as APPS / TACO's input_output

An assert test of the common forms is judged here, not in the program (code_asserts.py): the program's process
evaluates only the test's calls and sends their values back as plain data; the expected values and the comparison
never enter the sandbox, so nothing the program does in its process (objects equal to anything, patched builtins,
forged reports, reading its memory) can make a test pass. A test outside those forms runs in the program's process
as written and trusts it: the Verdict carries the sign `unverified_asserts`, and `unverified_asserts: refuse`
refuses such rows. A stdin/stdout test's output is compared here, line by line, each line's trailing whitespace
and the trailing blank lines ignored. Reward: the fraction of tests passed, or 1/0 with all_pass; the reason names
the first failure ("failed: test 3: AssertionError", "failed: test 2: timeout", "failed: test 1: wrong output",
"failed: program: SyntaxError: ... (line 4)"). Verdict.signs names what the hacking watch counts: the program
exited early (exited_early), raised a BaseException that is not an error (base_exception), returned a value that
is not plain data (not_plain), or ran a test outside the judged forms (unverified_asserts).

One sandbox call per response, in one warm sandbox per process (flashreinforce.sandbox, as the python_tool
environment uses it). Inside it, code_harness.py runs the program and then its assert tests one after another
in one process, or each stdin/stdout test in a process of its own, each test with its own wall and CPU
deadline, and reports per test: a test that hangs or crashes costs only itself (the tests after it go on in
a fresh process). A call that ends early (the program killed its harness, or the call went over the memory
limit) is resumed from the next test in a fresh call. All calls of one response share `time_budget_s`, which
should stay under the pool's verifier.timeout_s.
"""

from __future__ import annotations

import binascii
import dataclasses
import functools
import importlib.util
import json
import marshal
import math
import re
import textwrap
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from flashreinforce.sandbox import IsolationError, Sandbox, SandboxLimits
from flashreinforce.sandbox.records import HARD_OUTPUT_BYTES
from flashreinforce.types import Prompt, Verdict
from flashreinforce.verifiers import code_harness
from flashreinforce.verifiers.code_asserts import JudgedTest, asserts_nothing, judge, judged_test, outcomes_of, signs
from flashreinforce.verifiers.registry import RewardFn
from flashreinforce.verifiers.text import final_part

FIX = ('give a JSON list of assert statements (["assert f(1) == 2"]), of stdin/stdout pairs '
       '([{"input": "1\\n", "output": "2\\n"}]), or {"inputs": [...], "outputs": [...]} (docs/verifiers.md#code)')
PYTHON_TAGS = frozenset({"", "python", "py", "python3", "py3"})
UNVERIFIED = ("run", "refuse")
"""unverified_asserts: a test outside the judged forms runs in the program's process, or the row is refused."""
MAX_OUTPUT_BYTES = 512 << 10
"""The most output one test may keep: its frame (base64) must fit the sandbox's output cap with room to spare."""
WALL_SLACK_S = 0.5
"""A call's sandbox wall clock runs this long past the time left: the harness ends the call by itself first."""

_OPEN_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*([^\s`]*)[^`\n]*$")
_CLOSE_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*$")
_SANDBOXES: dict[tuple, Sandbox] = {}
_HARNESS: dict[Sandbox, str] = {}  # what each sandbox runs as the harness
_CALL_LOCK = threading.Lock()  # a call sets its sandbox's wall clock, then runs


@dataclass(frozen=True)
class CodeTests:
    """A row's tests: assert snippets, or stdin texts with their expected outputs."""

    kind: str  # "asserts" or "io"
    tests: tuple[str, ...]
    expected: tuple[str, ...] = ()
    judged: tuple[JudgedTest | None, ...] = ()
    """Assert tests: each one split for the verifier to judge, None where it runs as written (unverified)."""

    def unverified(self) -> list[int]:
        """The assert tests (from 1) outside the judged forms."""
        return [index + 1 for index, test in enumerate(self.judged) if test is None]


@dataclass(frozen=True)
class TestResult:
    passed: bool
    why: str = ""
    """Why it failed: "AssertionError", "timeout", "wrong output", ..."""
    output: str | None = None
    """A stdin/stdout test's output as the program wrote it (decoded as UTF-8, errors replaced)."""
    program: bool = False
    """The program itself failed (it does not compile, or an assert test's program raised or exited)."""
    signs: frozenset[str] = frozenset()
    """What the hacking watch counts (module docstring), whether or not the test passed."""


# ---- the ground truth ---------------------------------------------------------------------------------------

def check_ground_truth(text: str, *, unverified_asserts: str = "run") -> None:
    """Raise ValueError naming the problem and the fix when `text` is not a usable code ground truth (with
    unverified_asserts="refuse", also when an assert test is outside the forms the verifier judges)."""
    tests = parse_ground_truth(text)
    if unverified_asserts == "refuse" and tests.unverified():
        raise ValueError(f"code: tests {tests.unverified()} are not in a form the verifier judges outside the program "
                         "(assert CALL == EXPECTED, assert CALL, math.isclose(CALL, X), a HumanEval check "
                         "function of such asserts: docs/verifiers.md#what-the-verifier-judges); rewrite them, or "
                         "let them run trusting the program with unverified_asserts: run")


@functools.lru_cache(maxsize=4096)
def parse_ground_truth(text: str) -> CodeTests:
    """The row's tests (cached: every sample of a prompt brings the same ground truth)."""
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except ValueError as error:
        raise ValueError(f"code: the ground truth is not JSON ({error}): {text[:80]!r}; {FIX}") from None
    if isinstance(value, Mapping):
        return _parse_mapping(value)
    if not isinstance(value, list):
        raise ValueError(f"code: the ground truth is a JSON {_json_type(value)}, not a list of tests; {FIX}")
    if not value:
        raise ValueError(f"code: the ground truth has no tests; {FIX}")
    if all(isinstance(test, str) for test in value):
        for index, test in enumerate(value):
            _check_assert(index, test)
        return CodeTests("asserts", tuple(value), judged=tuple(judged_test(test) for test in value))
    if all(isinstance(test, Mapping) for test in value):
        for index, test in enumerate(value):
            if set(test) != {"input", "output"} or not all(isinstance(test[k], str) for k in ("input", "output")):
                raise ValueError(f"code: test {index + 1} is {json.dumps(test)[:120]}; a stdin/stdout test is "
                                 '{"input": "TEXT", "output": "TEXT"}, both strings, no other keys')
        return CodeTests("io", tuple(t["input"] for t in value), tuple(t["output"] for t in value))
    kinds = sorted({_json_type(test) for test in value})
    raise ValueError(f"code: the ground truth's tests are {' and '.join(k + 's' for k in kinds)}: all strings (asserts) or all "
                     f"objects (stdin/stdout), not a mix; {FIX}")


def _json_type(value: object) -> str:
    names = {str: "string", dict: "object", list: "array", bool: "boolean", int: "number", float: "number"}
    return names.get(type(value), "null")


def _parse_mapping(value: Mapping) -> CodeTests:
    if "fn_name" in value:
        raise ValueError("code: call-based tests (fn_name) are not supported; write each as an assert, "
                         '["assert NAME(*INPUTS) == OUTPUT", ...]')
    if set(value) != {"inputs", "outputs"}:
        raise ValueError(f"code: a ground-truth object needs exactly `inputs` and `outputs`, got "
                         f"{sorted(value)}; {FIX}")
    inputs, outputs = value["inputs"], value["outputs"]
    if not (isinstance(inputs, list) and isinstance(outputs, list) and len(inputs) == len(outputs)):
        raise ValueError("code: `inputs` and `outputs` must be lists of the same length (one string each per "
                         "test)")
    if not inputs:
        raise ValueError(f"code: the ground truth has no tests; {FIX}")
    if not all(isinstance(text, str) for text in (*inputs, *outputs)):
        raise ValueError("code: every input and output must be a string (a whole stdin, a whole stdout)")
    return CodeTests("io", tuple(inputs), tuple(outputs))


def _check_assert(index: int, test: str) -> None:
    if not test.strip():
        raise ValueError(f"code: test {index + 1} is empty; an assert test is Python, e.g. \"assert f(1) == 2\"")
    try:
        compile(test, f"<test {index + 1}>", "exec")  # the dataset's own text, not the model's
    except (SyntaxError, ValueError) as error:
        raise ValueError(f"code: test {index + 1} is not valid Python ({error}): {test[:120]!r}") from None
    defined = asserts_nothing(test)
    if defined:
        raise ValueError(f"code: test {index + 1} defines {', '.join(defined)} but never calls it, so it asserts "
                         f"nothing and every program would pass; call it (HumanEval: append \"check(ENTRY_POINT)\")")


# ---- the program ----------------------------------------------------------------------------------------------

def extract_program(completion: str) -> str | None:
    """The last complete Python (or untagged) fenced block after the last `</think>`; None when there is none."""
    text = final_part(completion)
    if text is None:
        return None
    lines, blocks, index = text.split("\n"), [], 0
    while index < len(lines):
        opening = _OPEN_FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        fence = opening.group(1)
        end = next((j for j in range(index + 1, len(lines)) if (m := _CLOSE_FENCE.match(lines[j]))
                    and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence)), None)
        if end is None:
            break  # a block that never closes: the response stopped inside it
        if opening.group(2).lower() in PYTHON_TAGS:
            blocks.append("\n".join(lines[index + 1:end]))
        index = end + 1
    program = textwrap.dedent(blocks[-1]) if blocks else ""
    return program if program.strip() else None


# ---- running the tests ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunSettings:
    test_timeout_s: float = 1.0
    time_budget_s: float = 4.0
    output_bytes: int = 64 << 10


def _harness_code(sandbox: Sandbox) -> str:
    """The harness as `sandbox` runs it: its code object (marshal) where the sandbox's Python reads this one's
    bytecode, else its source. Compiling the harness takes 5-6 ms on a 2-core machine, loading its code object
    0.08 ms (100 of each, timed in this interpreter): every call would pay the difference. The sandbox's Python
    is asked once."""
    if sandbox not in _HARNESS:
        source = Path(code_harness.__file__).read_text(encoding="utf-8")
        asked = sandbox.run("import importlib.util\nprint(importlib.util.MAGIC_NUMBER.hex())")
        if asked.output.strip() == importlib.util.MAGIC_NUMBER.hex():
            code = binascii.b2a_base64(marshal.dumps(compile(source, code_harness.__file__, "exec"))).decode()
            source = f"import binascii, marshal\nexec(marshal.loads(binascii.a2b_base64({code!r})))\n"
        _HARNESS[sandbox] = source
    return _HARNESS[sandbox]


def sandbox_limits(time_budget_s: float, memory_mb: int) -> SandboxLimits:
    """One call of the verifier: the whole budget (the harness keeps each test to its own deadline inside)."""
    return SandboxLimits(wall_s=time_budget_s + WALL_SLACK_S, cpu_s=math.ceil(time_budget_s) + 1,
                         memory_mb=memory_mb, output_bytes=HARD_OUTPUT_BYTES)


def shared_sandbox(limits: SandboxLimits, isolation: str, allow_unisolated: bool) -> Sandbox:
    """One warm sandbox per process and settings, started on first use and reused by every call."""
    key = (limits, isolation, allow_unisolated)
    if key not in _SANDBOXES:
        try:
            _SANDBOXES[key] = Sandbox(limits, isolation=isolation, allow_unisolated=allow_unisolated)
        except IsolationError as error:
            raise ValueError(f"code: {error} (the code verifier's own opt-in: "
                             "{kind: code, allow_unisolated: true})") from None
        except ValueError as error:  # an unknown isolation level
            raise ValueError(f"code: {error}") from None
    return _SANDBOXES[key]


def run_tests(sandbox: Sandbox, program: str, tests: CodeTests, settings: RunSettings) -> list[TestResult]:
    """Every test's result, in order. Tests the time budget left unrun fail with that reason."""
    results: list[TestResult | None] = [None] * len(tests.tests)
    start, first = time.monotonic(), 0
    while first < len(results):
        left = settings.time_budget_s - (time.monotonic() - start)
        if left <= 0:
            break
        payload = {"mode": tests.kind, "program": program, "tests": _sent_tests(tests), "first": first,
                   "test_s": settings.test_timeout_s, "cpu_s": math.ceil(settings.test_timeout_s),
                   "budget_s": left, "output_bytes": settings.output_bytes,
                   "frame_room": sandbox.limits.output_bytes - 4096}
        call = _run_call(sandbox, _harness_code(sandbox) + f"\nmain({json.dumps(payload)!r})\n", left)
        first = _take_frames(call, tests, results, first, settings)
        if first is None:
            break
    unrun = TestResult(False, f"not run (the time budget of {settings.time_budget_s:g} s ran out)")
    return [unrun if result is None else result for result in results]


def _sent_tests(tests: CodeTests) -> list:
    """What the sandbox gets of each test: a stdin text; a judged assert test's imports and calls (never its
    expected values, nor its text); the text of an assert test outside the judged forms."""
    if tests.kind == "io":
        return list(tests.tests)
    return [{"source": text} if judged is None else {"setup": list(judged.setup), "calls": list(judged.calls)}
            for text, judged in zip(tests.tests, tests.judged)]


def _run_call(sandbox: Sandbox, code: str, left: float):
    """One sandbox call whose own wall clock ends a little after the time left: the harness ends the call by
    itself before then, unless the program stopped it (SIGSTOP), which this bounds."""
    with _CALL_LOCK:
        sandbox.limits = dataclasses.replace(sandbox.limits, wall_s=left + WALL_SLACK_S)
        return sandbox.run(code)


def _take_frames(call, tests: CodeTests, results: list, first: int, settings: RunSettings) -> int | None:
    """Record what one call's frames say; the test to start the next call at, or None when there is none."""
    frames, noise = [], []
    for line in call.output.splitlines():
        try:
            frames.append(json.loads(line[len(code_harness.FRAME):]) if line.startswith(code_harness.FRAME) else None)
        except ValueError:
            frames.append(None)
        if frames[-1] is None and line.strip():
            noise.append(line)
    frames = [frame for frame in frames if isinstance(frame, dict)]
    for frame in frames:
        if "test" in frame:
            if not (isinstance(frame["test"], int) and first <= frame["test"] < len(results)):
                raise RuntimeError(f"code: the test harness sent a frame for no such test: {frame}")
            results[frame["test"]] = _judge(frame, tests, settings)
        elif "program" in frame:
            failed = TestResult(False, _why(frame["program"], settings, program=True), program=True,
                                signs=_ending_signs(frame["program"]))
            results[first:] = [failed if r is None else r for r in results[first:]]
            return None
        elif "budget" in frame:
            return None
        elif "resume" in frame:
            return frame["resume"]
    unfinished = next((i for i in range(first, len(results)) if results[i] is None), None)
    if unfinished is None:
        return None
    if noise and call.exit_code not in (None, 0) or not frames and call.exit_code == 0:
        # The harness itself failed, or the sandbox could not set the call up: not the program's doing.
        raise RuntimeError(f"code: the test harness failed in the sandbox: {' | '.join(noise[-3:])[-500:]}")
    # The call ended during this test: the program killed its harness, or the call went over its limits.
    how = "timeout" if call.timed_out else "out of memory" if call.over_memory else \
        f"killed by {call.killed_by}" if call.killed_by else f"exit code {call.exit_code}"
    # Only the program could end its harness by a signal or an exit: it left before its test did.
    left = frozenset() if call.timed_out or call.over_memory else frozenset({"exited_early"})
    results[unfinished] = TestResult(False, f"the call ended ({how})", signs=left)
    return unfinished + 1


def _judge(frame: dict, tests: CodeTests, settings: RunSettings) -> TestResult:
    if tests.kind == "asserts":
        return _judge_assert(frame, tests.judged[frame["test"]], settings)
    output = binascii.a2b_base64(frame.get("output", "")).decode("utf-8", errors="replace")
    if frame["status"] != "ok":  # a script may exit or die of a signal: only a BaseException is a sign here
        return TestResult(False, _why(frame, settings), output, signs=_ending_signs(frame, exits=False))
    if _lines(output) != _lines(tests.expected[frame["test"]]):
        return TestResult(False, "wrong output", output)
    return TestResult(True, "", output)


def _judge_assert(frame: dict, judged: JudgedTest | None, settings: RunSettings) -> TestResult:
    """A judged test passes only on its calls' values, compared here; one outside the forms on the program's word."""
    trusted = frozenset() if judged is not None else frozenset({"unverified_asserts"})
    if frame["status"] != "ok":
        return TestResult(False, _why(frame, settings), signs=_ending_signs(frame) | trusted)
    if judged is None:
        return TestResult(True, "", signs=trusted)
    outcomes = outcomes_of(frame.get("values"), len(judged.calls))
    passed, why = judge(judged, outcomes)
    return TestResult(passed, why, signs=signs(outcomes))


def _ending_signs(frame: dict, exits: bool = True) -> frozenset[str]:
    """The hacking watch's signs of how a test or the program ended: it exited (or killed itself) where it should
    have returned (`exits`), or a BaseException that is not an error ended it."""
    if exits and frame["status"] in ("exit", "killed"):
        return frozenset({"exited_early"})
    return frozenset({"base_exception"}) if frame.get("base") is True else frozenset()


def _lines(text: str) -> list[str]:
    """Text as compared: lines without their trailing whitespace, trailing blank lines dropped."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _why(frame: dict, settings: RunSettings, *, program: bool = False) -> str:
    status, detail = frame["status"], frame.get("detail", "")
    if status == "exit" and program:
        return f"exited before the tests ran ({detail})"
    return {"error": detail, "exit": f"exited ({detail})", "timeout": "timeout", "cpu": "timeout (CPU)",
            "killed": f"killed by {detail}", "output": f"output over {settings.output_bytes} bytes",
            "budget": f"timeout (the time budget of {settings.time_budget_s:g} s ran out)"}.get(status, status)


# ---- the verifier ---------------------------------------------------------------------------------------------

def verdict_of(results: Sequence[TestResult], all_pass: bool) -> Verdict:
    passed = sum(result.passed for result in results)
    failed = next((index for index, result in enumerate(results) if not result.passed), None)
    seen = tuple(sorted(frozenset().union(*(result.signs for result in results))))
    if failed is None:
        return Verdict(reward=1.0, passed=True, reason="ok", signs=seen)
    where = "program" if results[failed].program else f"test {failed + 1}"
    reward = 0.0 if all_pass else passed / len(results)
    return Verdict(reward=reward, passed=False, reason=f"failed: {where}: {results[failed].why}", signs=seen)


def code_verifier(*, all_pass: bool = False, test_timeout_s: float = 1.0, time_budget_s: float = 4.0,
                  memory_mb: int = 512, output_bytes: int = 64 << 10, language: str = "python",
                  isolation: str = "auto", allow_unisolated: bool = False, unverified_asserts: str = "run") -> RewardFn:
    """The response's program against the row's tests, in the sandbox (module docstring; docs/verifiers.md)."""
    if language != "python":
        raise ValueError(f"code: language {language!r} is not supported; the sandbox runs Python: "
                         "language: python")
    if not all(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
               for value in (test_timeout_s, time_budget_s)) or not 0 < test_timeout_s <= time_budget_s:
        raise ValueError(f"code: test_timeout_s={test_timeout_s}, time_budget_s={time_budget_s}: need 0 < "
                         "test_timeout_s <= time_budget_s (the budget covers all of a response's tests; keep "
                         "it under verifier.timeout_s)")
    if isinstance(output_bytes, bool) or not isinstance(output_bytes, int) or not 0 < output_bytes <= MAX_OUTPUT_BYTES:
        raise ValueError(f"code: output_bytes={output_bytes!r}: a whole number of bytes from 1 to {MAX_OUTPUT_BYTES}")
    if not isinstance(all_pass, bool) or not isinstance(allow_unisolated, bool):
        raise ValueError("code: all_pass and allow_unisolated are true or false")
    if unverified_asserts not in UNVERIFIED:
        raise ValueError(f"code: unverified_asserts={unverified_asserts!r}: one of {', '.join(UNVERIFIED)} (whether an "
                         "assert test outside the forms the verifier judges runs in the program's process, trusting "
                         "it, or is refused)")
    try:
        limits = sandbox_limits(time_budget_s, memory_mb)
    except ValueError as error:
        raise ValueError(f"code: {error}") from None
    # Started now, so that a machine with no sandbox stops the run when the pool starts, not on every call.
    shared_sandbox(limits, isolation, allow_unisolated)
    settings = RunSettings(test_timeout_s, time_budget_s, output_bytes)

    def score(completion: str, ground_truth: str, prompt: Prompt) -> Verdict:
        check_ground_truth(ground_truth, unverified_asserts=unverified_asserts)
        tests = parse_ground_truth(ground_truth)
        program = extract_program(completion)
        if program is None:
            return Verdict(reward=0.0, passed=False, reason="no_code")
        sandbox = shared_sandbox(limits, isolation, allow_unisolated)
        return verdict_of(run_tests(sandbox, program, tests, settings), all_pass)
    return score
