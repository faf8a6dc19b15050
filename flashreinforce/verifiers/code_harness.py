"""The code verifier's harness: the program it runs in the sandbox, one sandbox call per response.

It goes into the sandbox compiled (where the sandbox's Python is the verifier's own) or as source, with
`main(PAYLOAD)` appended, and runs as the call's program on the Python under /usr: it imports the standard
library only. The verifier imports it only for the frame format. The payload holds the response's program,
its tests (assert snippets, or stdin texts; the expected outputs stay outside, so the program cannot read
them), the per-test deadline and the call's time budget.

The harness is the call's first process and runs no untrusted code itself: it forks children that do, and
supervises them. Assert tests: one child runs the program, then each test in turn, saying on a pipe of its
own when each starts and how it ended; the harness holds each test to its deadline, and when one hangs or
ends the child, kills it and everything it started and goes on from the next test in a fresh child (which
runs the program again). A judged assert test (verifiers/code_asserts.py) comes as its imports and its calls
only: the child evaluates each call and sends its value back as plain data (code_asserts's wire format), and
the verifier compares it with the expected value, which never enters the sandbox. A test outside those forms
comes as its text and runs as written. Stdin/stdout tests: one child per test, as a judge runs a program per
input. The harness writes one frame per test on its stdout, the sandbox's output pipe, as soon as the test is
over. Children cannot write frames: they hold neither the output pipe nor a way to reopen it (the harness makes
itself undumpable, which also hides it from their /proc). What a child says about its tests is a claim by the
process that runs the program: the harness relays it, and the verifier judges values and output itself.

Frames are lines `@code {json}`:
    {"test": i, "status": S, "detail": D, "output": BASE64}   one per test run (output: stdin/stdout tests;
                                                              "values": BASE64 of a judged test's call outcomes;
                                                              "base": true when a BaseException ended it)
    {"program": {"status": S, "detail": D}}                   the program cannot run at all: every test fails
    {"budget": i}                                             the time budget ran out before test i
    {"resume": i}                                             the output cap is near: run from test i anew
S is ok, error, exit, timeout, cpu, killed, output or budget.
"""

# The system's python3 may be older than ours: annotations stay unevaluated strings.
from __future__ import annotations

import binascii
import builtins
import collections
import ctypes
import json
import math
import os
import resource
import select
import signal
import sys
import time
import types

FRAME = "@code "
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36
REPORT_FD = 3  # the child's report pipe: one JSON object per line
LINE_BYTES = 1 << 16  # the longest report line kept beyond a test's values; a longer one is not heard
MAX_DEPTH = 64  # code_asserts.MAX_DEPTH: this file imports nothing of ours
DETAIL_CHARS = 300
FRAME_OVERHEAD = 1024  # a frame's JSON around its output, with room to spare
HARNESS_GROWTH_BYTES = 32 << 20  # what the harness may add to its resident memory while a child runs

_libc = ctypes.CDLL(None, use_errno=True)


def frame_bytes(output_cap: int) -> int:
    """The largest frame of one test: its output (base64) and the rest."""
    return 4 * math.ceil(output_cap / 3) + FRAME_OVERHEAD


def _prctl(option: int, value: int) -> None:
    # prctl is variadic: every argument goes as a full unsigned long.
    args = [ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)]
    if _libc.prctl(ctypes.c_int(option), *args) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option})")


def _describe(error: BaseException) -> str:
    try:
        text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        if isinstance(error, SyntaxError) and error.lineno:
            text = f"{type(error).__name__}: {error.msg} (line {error.lineno})"
    except Exception:  # noqa: BLE001 - a program's exception may fail even to print itself
        text = type(error).__name__
    return text[:DETAIL_CHARS]


class _Frames:
    """The frames the harness writes, and the room left for them under the sandbox's output cap."""

    def __init__(self, room: int) -> None:
        self.room = room

    def fits(self, size: int) -> bool:
        return self.room - size >= FRAME_OVERHEAD

    def emit(self, message: dict) -> None:
        data = memoryview((FRAME + json.dumps(message, separators=(",", ":")) + "\n").encode())
        self.room -= len(data)
        while data:
            data = data[os.write(1, data):]


# -- in the child ------------------------------------------------------------------------------------------------

def _say(message: dict) -> None:
    """One report line to the harness (a closed pipe means the harness is gone: say nothing)."""
    try:
        os.write(REPORT_FD, (json.dumps(message) + "\n").encode())
    except OSError:
        pass


def _enter_child(fds: dict, cpu_s: int) -> None:
    """Become the process a fresh `python3 solution.py < input` would be: its own stdin, stdout and stderr, the
    report pipe on fd 3, nothing else of the harness's, a CPU limit of its own."""
    _prctl(PR_SET_DUMPABLE, 1)  # a plain process again: it may read its own /proc/self
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a script has it (the harness ignores it)
    os.dup2(fds["stdin"], 0)
    os.dup2(fds["stdout"], 1)
    os.dup2(fds["devnull"], 2)
    os.dup2(fds["report"], REPORT_FD)
    os.closerange(REPORT_FD + 1, max(REPORT_FD + 1, os.sysconf("SC_OPEN_MAX")))
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = cpu_s if hard == resource.RLIM_INFINITY else min(cpu_s, hard)
    hard = soft + 1 if hard == resource.RLIM_INFINITY else min(soft + 1, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))  # SIGXCPU at soft, SIGKILL a second later
    _leave_the_harness_room()
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the program's stdin for its whole life
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - block-buffered into a pipe, as a script's is
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.argv = ["solution.py"]


def _leave_the_harness_room() -> None:
    """Lower the child's address-space limit by the harness's resident memory (and its growth).

    The sandbox ends the whole call when its processes' resident memory together passes the same figure as
    each one's address-space limit. A child that could fill its own limit would race that guard: sometimes a
    MemoryError the harness reports as the program's, sometimes the call killed mid-test. With this room the
    child always meets its MemoryError first; only processes it starts can still end the call together."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as statm:  # just forked: our resident pages are the harness's too
        size, resident = (int(field) * page for field in statm.read().split()[:2])
    limit = soft - resident - HARNESS_GROWTH_BYTES
    if limit > size:  # a limit this small leaves the child nothing: the sandbox's guard decides instead
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _program(source: str) -> tuple:
    """The program compiled, and the fresh __main__ it runs in; a program that does not compile ends here."""
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    try:
        return compile(source, "<solution>", "exec"), main.__dict__
    except (SyntaxError, ValueError, MemoryError, RecursionError) as error:  # ValueError: a NUL byte
        _say({"syntax": _describe(error)})
        os._exit(1)


def _ended(error: BaseException) -> dict:
    """How a raise ended a program or a test, as the child reports it."""
    if isinstance(error, SystemExit):
        code = error.code
        return {"exit": code if isinstance(code, int) else (0 if code is None else 1), "detail": _describe(error)}
    if not isinstance(error, Exception):  # KeyboardInterrupt, GeneratorExit, a class of the program's own
        return {"error": _describe(error), "base": True}
    return {"error": _describe(error)}


def _finish_program() -> None:
    """What the interpreter does at a script's end: join its threads, run atexit, flush stdout."""
    if "threading" in sys.modules:
        sys.modules["threading"]._shutdown()
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.__stdout__):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def _io_child(payload: dict) -> None:
    """Run the program on this test's stdin as a script; never returns."""
    code, namespace = _program(payload["program"])
    try:
        exec(code, namespace)  # noqa: S102 - running it is this process's only job
        _finish_program()
        said = {"ok": True}
    except BaseException as error:  # noqa: BLE001 - whatever ended the program is the test's result
        said = _ended(error)
        if said.get("exit") == 0:  # sys.exit() or exit(0): a normal end
            _finish_program()
            said = {"ok": True}
    _say(said)
    os._exit(0 if "ok" in said else (said.get("exit", 1) & 0xFF) or 1)


def _assert_child(payload: dict, first: int) -> None:
    """Run the program, then each assert test from `first` in turn, each under its own CPU timer (SIGPROF,
    which ends the process, at test_s of CPU); report each start and end; never returns."""
    code, namespace = _program(payload["program"])
    signal.setitimer(signal.ITIMER_PROF, payload["test_s"])
    try:
        exec(code, namespace)  # noqa: S102 - running it is this process's only job
    except BaseException as error:  # noqa: BLE001 - a program that raises or exits fails every test
        _say(_ended(error))
        os._exit(1)
    _say({"ran": True})
    for index in range(first, len(payload["tests"])):
        _say({"start": index})
        signal.setitimer(signal.ITIMER_PROF, payload["test_s"])
        try:
            said = _run_test(payload["tests"][index], namespace, f"<test {index + 1}>", payload["output_bytes"])
        except BaseException as error:  # noqa: BLE001 - the test's result; the next test still runs
            said = _ended(error)
        signal.setitimer(signal.ITIMER_PROF, 0)
        _say({"done": index, **said})
    os._exit(0)


def _run_test(test: dict, namespace: dict, name: str, room: int) -> dict:
    """A test outside the judged forms runs as written; a judged one runs its imports, then evaluates each call
    and reports the outcomes (base64 of their JSON list), for the verifier to judge."""
    if "source" in test:
        exec(compile(test["source"], name, "exec"), namespace)  # noqa: S102
        return {"ok": True}
    for statement in test["setup"]:
        exec(compile(statement, name, "exec"), namespace)  # noqa: S102
    pieces = []
    for call in test["calls"]:
        piece = json.dumps(_outcome(call, namespace, name, room))
        room -= len(piece)
        pieces.append(piece if room >= 0 else json.dumps({"nonplain": "a value past the output cap"}))
    return {"values": binascii.b2a_base64(("[" + ",".join(pieces) + "]").encode(), newline=False).decode()}


def _outcome(call: str, namespace: dict, name: str, room: int) -> dict:
    """One call's outcome: its value as plain data, or what kept it from having one."""
    try:
        value = eval(compile(call, name, "eval"), namespace)  # noqa: S307 - the program's own call, in its process
    except BaseException as error:  # noqa: BLE001 - what the call raised is its outcome
        return _ended(error)
    try:
        return {"value": _wire(value, 0, [room])}
    except _NotPlain as error:
        return {"nonplain": str(error)[:DETAIL_CHARS]}
    except BaseException as error:  # noqa: BLE001 - the program broke what reads its value (a recursion limit)
        return {"nonplain": f"a value that could not be read ({_describe(error)})"}


class _NotPlain(Exception):
    pass


_DICTS = (dict, collections.Counter, collections.OrderedDict, collections.defaultdict)  # compared as plain dicts
_SCALARS = (bool, int, float, str, bytes, list, tuple, set, frozenset, dict)


def _wire(value: object, depth: int, room: list) -> object:
    """The value in code_asserts's wire format: exact plain types only, nothing of the value's own code run (no
    __eq__, __iter__ or __repr__ of the program's); _NotPlain for anything else, too deep or too big."""
    kind = type(value)
    room[0] -= 8
    if room[0] < 0:
        raise _NotPlain("a value past the output cap")
    if depth > MAX_DEPTH:
        raise _NotPlain(f"a value nested over {MAX_DEPTH} deep (or holding itself)")
    if value is None or kind is bool or kind is float:
        return value
    if kind is str or kind is bytes:
        room[0] -= 2 * len(value)
        if room[0] < 0:
            raise _NotPlain("a value past the output cap")
        return value if kind is str else {"bytes": value.hex()}
    if kind is int:
        room[0] -= value.bit_length() // 3
        return value if -(1 << 63) < value < 1 << 63 else {"int": hex(value)}
    if kind is list:
        return [_wire(item, depth + 1, room) for item in list.__iter__(value)]
    if kind is tuple or kind is set or kind is frozenset:
        return {kind.__name__: [_wire(item, depth + 1, room) for item in kind.__iter__(value)]}
    if kind in _DICTS:
        return {"dict": [[_wire(k, depth + 1, room), _wire(v, depth + 1, room)] for k, v in dict.items(value)]}
    raise _NotPlain(_kind_of(value))


def _kind_of(value: object) -> str:
    """"a Foo object", "an int subclass (Foo)", "a function": what a value that is not plain data is."""
    kind = type(value)
    name = type.__dict__["__qualname__"].__get__(kind)
    base = next((b for b in _SCALARS if issubclass(kind, b)), None)
    if base is not None:
        article = "an" if base.__name__[0] in "aeiou" else "a"
        return f"{article} {base.__name__} subclass ({name})"
    article = "an" if name[:1].lower() in "aeiou" else "a"
    return f"{article} {name} object"


# -- in the harness: one child -----------------------------------------------------------------------------------

def _descendants(pid: str = "self") -> list:
    # sandbox/worker.py walks the same way: this file runs alone in the sandbox and imports nothing of ours
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as children:
                for child in children.read().split():
                    found += [int(child), *_descendants(child)]
        except (FileNotFoundError, ProcessLookupError):
            continue  # it exited while we looked
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _end_child(pid: int) -> int:
    """Kill the child (if it still runs) and every process it started, reap them all; the child's wait status.
    The harness is their subreaper: whatever they started comes back to it when its parent dies."""
    _kill(pid)
    _, status = os.waitpid(pid, 0)
    while True:
        for process in _descendants():
            _kill(process)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return status


def _start(child, payload: dict, fds: dict, cpu_s: int, *args) -> int:
    """Fork a child that runs child(payload, *args) behind the fds; its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            _enter_child(fds, cpu_s)
        except BaseException as error:  # noqa: BLE001 - never run the program with a limit missing
            _say({"error": f"the test could not be set up: {_describe(error)}"})
            os._exit(125)
        child(payload, *args)
    return pid


class _Child:
    """A running child: its report pipe read line by line, its output pipe (stdin/stdout tests) up to a cap."""

    def __init__(self, pid: int, report: int, output: int | None, output_cap: int,
                 line_bytes: int = LINE_BYTES) -> None:
        self.pid, self.report, self.output, self.cap, self.line_bytes = pid, report, output, output_cap, line_bytes
        self.pending, self.out = bytearray(), bytearray()
        self.pidfd = os.pidfd_open(pid)
        self.poller = select.poll()
        for fd in (self.pidfd, report, output):
            if fd is not None:
                self.poller.register(fd, select.POLLIN)

    def wait(self, deadline: float) -> tuple:
        """(messages, ending): what the child said until it exited ("exited"), reached the deadline
        ("timeout"), flooded its output ("output"), or said something (None: it still runs)."""
        left = deadline - time.monotonic()
        if left <= 0:
            return [], "timeout"
        messages = []
        for fd, _ in self.poller.poll(left * 1000):
            if fd == self.pidfd:
                return messages, "exited"
            if not self._read(fd, messages):
                self.poller.unregister(fd)
            elif fd == self.output and len(self.out) > self.cap:
                return messages, "output"
        return messages, None

    def end(self) -> tuple:
        """Kill and reap it and all it started; (wait status, what it said last)."""
        status = _end_child(self.pid)
        os.close(self.pidfd)
        messages = []
        for fd in (self.report, self.output):
            while fd is not None and len(self.out) <= self.cap and self._read(fd, messages):
                pass  # every writer is dead: this ends at the pipes' end
        return status, messages

    def close(self) -> None:
        for fd in (self.report, self.output):
            if fd is not None:
                os.close(fd)

    def _read(self, fd: int, messages: list) -> bool:
        chunk = os.read(fd, 1 << 16)
        if fd == self.output:
            self.out += chunk
            return bool(chunk)
        *lines, rest = (self.pending + chunk).split(b"\n")
        self.pending = bytearray(rest[:self.line_bytes])
        for line in lines:
            try:
                message = json.loads(line)
            except (ValueError, RecursionError):  # RecursionError: a line nested past json's limit
                continue
            if isinstance(message, dict):
                messages.append(message)
        return bool(chunk)


def _death(status: int) -> dict:
    """A child that ended without saying how: its signal or exit code."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return {"status": "cpu" if number in (signal.SIGXCPU, signal.SIGPROF) else "killed", "detail": name}
    return {"status": "exit", "detail": f"exit code {os.waitstatus_to_exitcode(status)}"}


def _last_said(messages: list, said: dict | None) -> dict | None:
    for message in messages:
        said = _said(message) or said
    return said


def _said(message: dict) -> dict | None:
    """A child's own account of how the program or a test ended, as a frame's status; None if it is not one."""
    if "syntax" in message:
        return {"status": "error", "detail": str(message["syntax"])[:DETAIL_CHARS], "syntax": True}
    if message.get("ok") is True:
        return {"status": "ok", "detail": ""}
    if isinstance(message.get("values"), str):  # a judged test's outcomes: relayed for the verifier to read
        return {"status": "ok", "detail": "", "values": message["values"]}
    if "error" in message:
        base = {"base": True} if message.get("base") is True else {}
        return {"status": "error", "detail": str(message["error"])[:DETAIL_CHARS], **base}
    if "exit" in message:
        return {"status": "exit", "detail": str(message.get("detail", ""))[:DETAIL_CHARS]}
    return None


# -- in the harness: the tests ---------------------------------------------------------------------------------

def _stdin_file(text: str) -> int:
    """The test's input as an unnamed file at offset 0: `open(0)`, `sys.stdin.buffer` and `input()` all read it."""
    try:
        fd = os.open(".", os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError:  # a file system without O_TMPFILE: a named file, unlinked at once
        name = f".stdin-{os.getpid()}"
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.unlink(name)
    try:
        data = memoryview(text.encode("utf-8", "surrogatepass"))
        while data:
            data = data[os.write(fd, data):]
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


def _io_test(payload: dict, index: int, seconds: float, devnull: int) -> dict:
    """One stdin/stdout test in a child of its own: its frame, with the output the program wrote."""
    opened = []
    try:
        opened += os.pipe()
        opened += os.pipe()
        opened.append(_stdin_file(payload["tests"][index]))
        fds = {"stdin": opened[4], "stdout": opened[3], "devnull": devnull, "report": opened[1]}
        pid = _start(_io_child, payload, fds, payload["cpu_s"])
    except OSError as error:  # e.g. an earlier test filled the call's scratch: this one cannot get its input
        for fd in opened:
            os.close(fd)
        return {"test": index, "status": "error", "detail": f"the test could not be set up: {_describe(error)}",
                "output": ""}
    for fd in opened[1], opened[3], opened[4]:
        os.close(fd)  # the child's ends: end of file on our side means every writer is gone
    child, said, ending = _Child(pid, opened[0], opened[2], payload["output_bytes"]), None, None
    deadline = time.monotonic() + seconds
    while ending is None:
        messages, ending = child.wait(deadline)
        said = _last_said(messages, said)
    status, messages = child.end()
    said = _last_said(messages, said)
    child.close()
    if said is not None and said.pop("syntax", False):
        return {"program": said}  # it does not compile: no input will change that
    if len(child.out) > child.cap:
        result = {"status": "output", "detail": ""}
    elif said is not None:
        result = said
    elif ending == "timeout":
        result = {"status": "timeout", "detail": ""}
    elif os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        result = {"status": "ok", "detail": ""}  # os._exit(0) after printing: its output is what counts
    else:
        result = _death(status)
    output = binascii.b2a_base64(bytes(child.out[:child.cap]), newline=False).decode()
    return {"test": index, **result, "output": output}


class _AssertRun:
    """One child running the program and the assert tests from `first`; the harness's view of where it is."""

    def __init__(self, payload: dict, first: int, frames: _Frames, end: float) -> None:
        self.payload, self.frames, self.end = payload, frames, end
        self.ran, self.next, self.running = False, first, None  # the next test to report; the one started
        self.failed: dict | None = None  # how the program itself ended, when it did not get to the tests
        self.capped = False  # the current deadline is the time budget's, not the test's own
        self.deadline = self._deadline()

    def _deadline(self) -> float:
        own = time.monotonic() + self.payload["test_s"]
        self.capped = own > self.end
        return min(own, self.end)

    def hear(self, messages: list) -> bool:
        """Follow what the child says; False once the output cap is near (the verifier resumes from here)."""
        for message in messages:
            if message.get("ran") is True and not self.ran:
                self.ran, self.deadline = True, self._deadline()
            elif self.ran and message.get("start") == self.next and self.running is None:
                self.running, self.deadline = self.next, self._deadline()
            elif self.ran and "done" in message and message["done"] == self.running:
                result = _said(message) or {"status": "error", "detail": "no result"}
                if not self.frames.fits(len(result.get("values", "")) + FRAME_OVERHEAD):
                    self.frames.emit({"resume": self.running})
                    return False
                self.frames.emit({"test": self.running, **result})
                self.next, self.running, self.deadline = self.running + 1, None, self._deadline()
            elif not self.ran:
                said = _said(message)  # the program raised, exited, or does not compile; "ok" is no ending
                if said is not None and said["status"] != "ok" and not {"start", "done"} & set(message):
                    said.pop("syntax", None)
                    self.failed = said
        return True

    def after(self, ending: str, status: int) -> int | None:
        """When the child is gone: the frame of the test (or program) it ended in, and where to go on."""
        if self.next >= len(self.payload["tests"]):
            return None
        if ending == "timeout":
            result = {"status": "budget" if self.capped else "timeout", "detail": ""}
        else:
            result = _death(status)
        if not self.ran:
            self.frames.emit({"program": self.failed or result})
            return None
        self.frames.emit({"test": self.next, **result})
        return self.next + 1


def _assert_tests(payload: dict, first: int, frames: _Frames, devnull: int, end: float) -> int | None:
    """Run the tests from `first` in one child; the test to go on from in a fresh child, or None when done."""
    # CPU per test is the child's SIGPROF timer; this only bounds the child's whole life.
    lifetime_cpu = payload["cpu_s"] * (len(payload["tests"]) - first + 1) + 1
    report_read = report_write = None
    try:
        report_read, report_write = os.pipe()
        fds = {"stdin": devnull, "stdout": devnull, "devnull": devnull, "report": report_write}
        pid = _start(_assert_child, payload, fds, lifetime_cpu, first)
    except OSError as error:  # no process or pipe to be had right now: this test cannot run
        if report_read is not None:
            os.close(report_read)
        frames.emit({"test": first, "status": "error", "detail": f"the test could not be set up: {_describe(error)}"})
        return first + 1
    finally:
        if report_write is not None:
            os.close(report_write)
    line_bytes = LINE_BYTES + frame_bytes(payload["output_bytes"])  # a judged test's values, base64, in one line
    child, run = _Child(pid, report_read, None, 0, line_bytes), _AssertRun(payload, first, frames, end)
    ending = None
    while ending is None:
        messages, ending = child.wait(run.deadline)
        if not run.hear(messages):
            child.end()
            child.close()
            return None
    status, messages = child.end()
    child.close()
    if not run.hear(messages):
        return None
    return run.after(ending, status)


def main(payload_json: str) -> None:
    payload = json.loads(payload_json)
    # A test may signal us (we are its parent): SIGINT would raise in our own code. The signals that end us
    # end the call, which the verifier reads as the running test's doing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _prctl(PR_SET_DUMPABLE, 0)  # children may not open our /proc files: the output pipe, our memory
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # what a test starts and orphans comes back to us, to be killed
    devnull = os.open(os.devnull, os.O_RDWR)
    end = time.monotonic() + payload["budget_s"]
    frames = _Frames(payload["frame_room"])
    index = payload["first"]
    while index is not None and index < len(payload["tests"]):
        left = end - time.monotonic()
        if left <= 0.01:
            frames.emit({"budget": index})
            return
        if payload["mode"] == "asserts":
            index = _assert_tests(payload, index, frames, devnull, end)
            continue
        if not frames.fits(frame_bytes(payload["output_bytes"])):
            frames.emit({"resume": index})
            return
        seconds = min(payload["test_s"], left)
        result = _io_test(payload, index, seconds, devnull)
        if "program" in result:
            frames.emit(result)
            return
        if result["status"] == "timeout" and seconds < payload["test_s"]:
            result["status"] = "budget"
        frames.emit(result)
        index += 1
