"""Assert tests judged by the verifier, not by the program: a test's text split into the calls the program's process
evaluates and the checks that only the verifier sees.

A test is parsed here (it is the dataset's text, never the model's). An `assert` of the common MBPP / HumanEval
forms becomes a check over the values of its calls: `assert CALL == EXPECTED` (any comparison, chained),
`assert CALL`, `assert not CALL`, `assert abs(CALL - X) < tol`, `assert round(CALL, 2) == X`,
`assert math.isclose(CALL, X, ...)`, `assert isinstance(CALL, T)`, and `and` / `or` of them. A CALL is the
largest part of the assert that uses the program and holds no expected value (`set(f(x))`, `len(f(x))`, `f(x)[0]`);
the program's process evaluates only that text and sends the value back as plain data (the wire format below).
Expected values, the comparison and the assert's text stay here. A test may also import modules (run in the
program's namespace before its calls), bind names to constants, and be a HumanEval check function called on the
entry point. Anything else (a loop, a call's result kept in a variable, two calls compared with each other) is not
judged here: `judged_test` gives None and the test runs in the program's process as written, trusting it.

The wire format of a value (JSON): null, true, false, numbers (an int past 2**63 as {"int": "-0x..."}), strings,
lists as arrays, {"tuple": [...]}, {"set": [...]}, {"frozenset": [...]}, {"dict": [[key, value], ...]} and
{"bytes": "hex"}, at most MAX_DEPTH deep. What a call sent is one outcome: {"value": V}, {"nonplain": WHAT},
{"error": WHAT, "base": true when not an Exception}, or {"exit": CODE, "detail": WHAT}.
"""

from __future__ import annotations

import ast
import binascii
import copy
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 64
"""Nesting of a value sent back; the harness refuses deeper ones (or one that contains itself) as not plain data."""
CALL = "\0call"
"""The placeholder name of a call's value in a check: no source text can spell it."""
SINGLETONS = (None, True, False, Ellipsis)  # what `is` may compare a value with

_MATH = {name: getattr(math, name) for name in (
    "isclose", "fabs", "sqrt", "floor", "ceil", "trunc", "exp", "log", "log2", "log10", "hypot", "isnan", "isinf",
    "isfinite", "pi", "e", "tau", "inf", "nan")}
_NUMERIC = frozenset({"abs", "round", "float", "int", "math.fabs", "math.floor", "math.ceil", "math.trunc",
                      "math.sqrt"})  # what may wrap a value before it meets an expected one: abs(CALL - X)
_BUILTINS: dict[str, Any] = {f.__name__: f for f in (
    abs, round, len, min, max, sum, sorted, set, frozenset, tuple, list, dict, str, int, float, bool, bytes,
    isinstance, type)}
_SCAFFOLD = (ast.expr_context, ast.operator, ast.unaryop, ast.cmpop, ast.boolop, ast.keyword)
_VALUE_NODES = (ast.Constant, ast.Name, ast.Attribute, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.UnaryOp, ast.BinOp,
                ast.BoolOp, ast.Compare, ast.Call)
_HEX_INT = re.compile(r"-?0x[0-9a-f]+")
_MAX_ITEMS = 1 << 20  # a sequence the verifier's own arithmetic may build (`[0] * n`), or a power's bits


@dataclass(frozen=True)
class JudgedTest:
    """One assert test, split: what the program's process runs, and the checks the verifier evaluates."""

    setup: tuple[str, ...]
    """The test's import statements, run in the program's namespace before its calls."""
    calls: tuple[str, ...]
    """Expressions the program's process evaluates, in order; each one's value comes back as plain data."""
    checks: tuple[ast.expr, ...]
    """One per assert: its test, each call replaced by the name CALL + its index."""
    names: tuple[tuple[str, Any], ...]
    """Names the checks may use beyond the builtins above: the math module and functions the test imported."""


@dataclass(frozen=True)
class Failed:
    """A call that gave no value: why (as the test's reason) and the hacking watch's sign, if any."""

    why: str
    sign: str | None = None


class NotPlain(ValueError):
    """A value that is not plain data, or not readable as such."""


class _Outside(Exception):
    """The test is not in a form this module judges."""


# ---- splitting a test -------------------------------------------------------------------------------------------

def judged_test(source: str) -> JudgedTest | None:
    """The test split into setup, calls and checks; None when it is not in a form judged here."""
    try:
        return _Splitter().module(ast.parse(source))
    except (_Outside, SyntaxError, ValueError, RecursionError):  # RecursionError: a test nested too deep to walk
        return None


def asserts_nothing(source: str) -> list[str]:
    """The functions a test defines when it only defines things and never calls them (a HumanEval test without
    `check(ENTRY_POINT)`, which would pass whatever the program does); [] otherwise."""
    body = ast.parse(source).body
    inert = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom, ast.Assign, ast.Pass)
    docstring = [s for s in body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)]
    defined = [s.name for s in body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return defined if all(isinstance(s, inert) or s in docstring for s in body) else []


class _Splitter:
    def __init__(self) -> None:
        self.setup: list[str] = []
        self.calls: list[str] = []
        self.checks: list[ast.expr] = []
        self.constants: dict[str, ast.expr] = {}  # names the test binds to constants: inlined where used
        self.names: dict[str, Any] = {}  # the math module and math functions the test imported

    def module(self, tree: ast.Module) -> JudgedTest:
        functions = {s.name: s for s in tree.body if isinstance(s, ast.FunctionDef)}
        checks = {call[0].name for call in (_check_call(s, functions) for s in tree.body) if call is not None}
        if set(functions) - checks:
            raise _Outside  # a helper the asserts call: it would have to be defined in the program's process
        for statement in tree.body:
            if isinstance(statement, ast.FunctionDef):
                continue  # a check function: split where it is called
            call = _check_call(statement, functions)
            if call is not None:
                self.check_function(*call)
            else:
                self.statement(statement, {})
        return JudgedTest(tuple(self.setup), tuple(self.calls), tuple(self.checks), tuple(self.names.items()))

    def check_function(self, function: ast.FunctionDef, entry: str) -> None:
        """HumanEval's `def check(candidate): assert candidate(...) == ...` called as `check(ENTRY)`."""
        arguments = function.args
        if (function.decorator_list or len(arguments.args) != 1 or arguments.posonlyargs or arguments.vararg
                or arguments.kwonlyargs or arguments.kwarg or arguments.defaults):
            raise _Outside
        for statement in function.body:
            self.statement(statement, {arguments.args[0].arg: entry})

    def statement(self, statement: ast.stmt, renames: dict[str, str]) -> None:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            self.imports(statement)
        elif isinstance(statement, ast.Assert):
            test = _Inline(self.constants, renames).visit(copy.deepcopy(statement.test))
            self.checks.append(self.split_assert(test))
        elif (isinstance(statement, ast.Assign) and len(statement.targets) == 1
              and isinstance(statement.targets[0], ast.Name)):
            value = _Inline(self.constants, renames).visit(copy.deepcopy(statement.value))
            if not self.constant(value):
                raise _Outside  # a call's result kept in a variable: the program's process would have to keep it
            self.constants[statement.targets[0].id] = value
            self.names.pop(statement.targets[0].id, None)
        elif not (isinstance(statement, ast.Pass)
                  or isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)):
            raise _Outside

    def imports(self, statement: ast.Import | ast.ImportFrom) -> None:
        self.setup.append(ast.unparse(statement))
        for alias in statement.names:
            bound = alias.asname or alias.name.partition(".")[0]
            self.constants.pop(bound, None)
            if isinstance(statement, ast.Import) and alias.name == "math":
                self.names[bound] = math
            elif isinstance(statement, ast.ImportFrom) and statement.module == "math" and alias.name in _MATH:
                self.names[bound] = _MATH[alias.name]
            else:
                self.names.pop(bound, None)

    def constant(self, node: ast.expr) -> bool:
        """Whether the verifier computes the node alone: literals, and builtins and math over literals."""
        for sub in ast.walk(node):
            if isinstance(sub, _SCAFFOLD):
                continue
            if not isinstance(sub, _VALUE_NODES):
                return False
            if isinstance(sub, ast.Name) and not (sub.id in _BUILTINS or sub.id in self.names):
                return False
            if isinstance(sub, ast.Attribute) and self.trusted_attribute(sub) is None:
                return False
            if isinstance(sub, ast.Call) and (self.function_name(sub) is None or any(
                    isinstance(a, ast.Starred) for a in sub.args) or any(k.arg is None for k in sub.keywords)):
                return False
            if isinstance(sub, ast.Dict) and None in sub.keys:
                return False
        return True

    def trusted_attribute(self, node: ast.Attribute) -> Any:
        owner = node.value
        if isinstance(owner, ast.Name) and self.names.get(owner.id) is math and node.attr in _MATH:
            return _MATH[node.attr]
        return None

    def function_name(self, call: ast.Call) -> str | None:
        """"abs", "math.isclose", ...: a function the verifier may run, by the name it goes by here."""
        function = call.func
        if isinstance(function, ast.Name) and function.id in _BUILTINS:
            return function.id
        if isinstance(function, ast.Name) and callable(self.names.get(function.id)):
            return f"math.{self.names[function.id].__name__}"
        if isinstance(function, ast.Attribute) and callable(self.trusted_attribute(function)):
            return f"math.{function.attr}"
        return None

    def split_assert(self, node: ast.expr) -> ast.expr:
        """An assert's test with its calls taken out: the verifier evaluates what is left."""
        if self.constant(node):
            return node
        if isinstance(node, ast.BoolOp):
            return ast.BoolOp(node.op, [self.split_assert(value) for value in node.values])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return ast.UnaryOp(node.op, self.split_assert(node.operand))
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            open_ = [i for i, operand in enumerate(operands) if not self.constant(operand)]
            if len(open_) != 1:
                raise _Outside  # two calls compared with each other: the program would judge itself
            for i, op in enumerate(node.ops):
                if isinstance(op, (ast.Is, ast.IsNot)) and not _singleton(operands[i + 1 if i in open_ else i]):
                    raise _Outside  # identity with anything but None, True, False means nothing across processes
            operands[open_[0]] = self.value(operands[open_[0]])
            return ast.Compare(operands[0], node.ops, operands[1:])
        if isinstance(node, ast.Call) and self.function_name(node) in ("math.isclose", "isinstance"):
            return self.wrapped(node, must_mix=False)
        return self.value(node)

    def value(self, node: ast.expr) -> ast.expr:
        """A value that uses the program: a call, or arithmetic of one call with expected values (abs(CALL - X))."""
        if self.mixes(node):
            if isinstance(node, ast.BinOp):
                left, right = (self.value(node.left), node.right) if self.constant(node.right) \
                    else (node.left, self.value(node.right))
                return ast.BinOp(left, node.op, right)
            if isinstance(node, ast.UnaryOp):
                return ast.UnaryOp(node.op, self.value(node.operand))
            return self.wrapped(node, must_mix=True)
        self.calls.append(ast.unparse(node))
        return ast.Name(id=f"{CALL}{len(self.calls) - 1}", ctx=ast.Load())

    def mixes(self, node: ast.expr) -> bool:
        """Whether the node combines one program value with an expected one (or takes its type), so that it must be
        evaluated here."""
        if isinstance(node, ast.BinOp):
            return self.constant(node.left) != self.constant(node.right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return self.mixes(node.operand)
        if isinstance(node, ast.Call) and self.function_name(node) == "type" and len(node.args) == 1:
            return not self.constant(node.args[0])  # a type cannot travel as plain data: compared here
        if isinstance(node, ast.Call) and self.function_name(node) in _NUMERIC and not node.keywords:
            open_ = [a for a in node.args if not self.constant(a)]
            return len(open_) == 1 and not isinstance(open_[0], ast.Starred) and (
                len(node.args) > 1 or self.mixes(open_[0]))
        return False

    def wrapped(self, call: ast.Call, must_mix: bool) -> ast.Call:
        """A function the verifier runs, over one value of the program and expected values."""
        arguments = [*call.args, *(k.value for k in call.keywords)]
        open_ = [a for a in arguments if not self.constant(a)]
        if len(open_) != 1 or isinstance(open_[0], ast.Starred) or any(k.arg is None for k in call.keywords):
            raise _Outside
        assert not must_mix or self.mixes(call)
        swap = {id(open_[0]): self.value(open_[0])}
        return ast.Call(call.func, [swap.get(id(a), a) for a in call.args],
                        [ast.keyword(k.arg, swap.get(id(k.value), k.value)) for k in call.keywords])


def _check_call(statement: ast.stmt, functions: dict[str, ast.FunctionDef]) -> tuple[ast.FunctionDef, str] | None:
    """(the check function, the entry point's name) of a statement `check(ENTRY)`, else None."""
    if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)):
        return None
    call = statement.value
    if (isinstance(call.func, ast.Name) and call.func.id in functions and len(call.args) == 1 and not call.keywords
            and isinstance(call.args[0], ast.Name)):
        return functions[call.func.id], call.args[0].id
    return None


def _singleton(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and any(node.value is s for s in SINGLETONS)


class _Inline(ast.NodeTransformer):
    """Constants the test bound, written in where their names are used; a check function's parameter renamed to
    the entry point."""

    def __init__(self, constants: dict[str, ast.expr], renames: dict[str, str]) -> None:
        self.constants, self.renames = constants, renames

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if node.id in self.renames:
            return ast.copy_location(ast.Name(id=self.renames[node.id], ctx=node.ctx), node)
        if node.id in self.constants and isinstance(node.ctx, ast.Load):
            return self.constants[node.id]
        return node

    def visit_Lambda(self, node: ast.Lambda) -> ast.expr:
        return node  # its parameters may shadow the test's names: left as written (it is a call's anyway)


# ---- judging the values ----------------------------------------------------------------------------------------

def judge(test: JudgedTest, outcomes: Sequence[Any]) -> tuple[bool, str]:
    """(passed, why it failed) of the test's checks over its calls' outcomes (values, or Failed), in order, as the
    asserts would have run: the first check that is false fails with AssertionError, one that needs a call that
    raised fails with what it raised."""
    env = {f"{CALL}{i}": outcome for i, outcome in enumerate(outcomes)}
    names = {**_BUILTINS, **dict(test.names)}
    for check in test.checks:
        try:
            if not _evaluate(check, env, names):
                return False, "AssertionError"
        except _CallFailed as failed:
            return False, failed.why
        except Exception as error:  # noqa: BLE001 - the comparison itself raised (1 < "a"): the assert's error
            return False, _describe(error)
    return True, ""


def signs(outcomes: Sequence[Any]) -> frozenset[str]:
    """The hacking watch's signs of the outcomes, judged or not."""
    return frozenset(o.sign for o in outcomes if isinstance(o, Failed) and o.sign)


class _CallFailed(Exception):
    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def _evaluate(node: ast.expr, env: dict[str, Any], names: dict[str, Any]) -> Any:
    """A check's value, computed here from plain data alone."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in env:
            outcome = env[node.id]
            if isinstance(outcome, Failed):
                raise _CallFailed(outcome.why)
            return outcome
        return names[node.id]
    if isinstance(node, ast.Attribute):
        return _MATH[node.attr]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [_evaluate(e, env, names) for e in node.elts]
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        return {_evaluate(k, env, names): _evaluate(v, env, names) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.BoolOp):
        for value_node in node.values:
            value = _evaluate(value_node, env, names)
            if bool(value) == isinstance(node.op, ast.Or):
                return value
        return value
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, env, names)
        for op, right_node in zip(node.ops, node.comparators):
            right = _evaluate(right_node, env, names)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_evaluate(node.operand, env, names))
    if isinstance(node, ast.BinOp):
        return _binary(node.op, _evaluate(node.left, env, names), _evaluate(node.right, env, names))
    assert isinstance(node, ast.Call), ast.dump(node)
    function = _evaluate(node.func, env, names)
    return function(*(_evaluate(a, env, names) for a in node.args),
                    **{k.arg: _evaluate(k.value, env, names) for k in node.keywords})


_COMPARE = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
            ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
            ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b, ast.In: lambda a, b: a in b,
            ast.NotIn: lambda a, b: a not in b}
_UNARY = {ast.Not: lambda a: not a, ast.USub: lambda a: -a, ast.UAdd: lambda a: +a, ast.Invert: lambda a: ~a}
_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
           ast.Pow: lambda a, b: a ** b, ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b,
           ast.BitAnd: lambda a, b: a & b, ast.BitOr: lambda a, b: a | b, ast.BitXor: lambda a, b: a ^ b,
           ast.MatMult: lambda a, b: a @ b}


def _binary(op: ast.operator, a: Any, b: Any) -> Any:
    """a op b, refused where plain data could make it huge: a sequence repeated, a power, a shift, a format."""
    if isinstance(op, ast.Mult):
        n, sequence = (a, b) if isinstance(a, int) else (b, a)
        if isinstance(n, int) and isinstance(sequence, (str, bytes, list, tuple)) and n * len(sequence) > _MAX_ITEMS:
            raise OverflowError(f"a sequence of {n * len(sequence)} items is over {_MAX_ITEMS}")
    if isinstance(op, ast.Pow) and isinstance(a, int) and isinstance(b, int) and b > 0 and \
            abs(a) > 1 and b * a.bit_length() > _MAX_ITEMS:
        raise OverflowError(f"an integer power of over {_MAX_ITEMS} bits")
    if isinstance(op, ast.LShift) and isinstance(b, int) and b > _MAX_ITEMS:
        raise OverflowError(f"a shift of over {_MAX_ITEMS} bits")
    if isinstance(op, ast.Mod) and isinstance(a, (str, bytes)):
        raise TypeError("string formatting is not evaluated by the verifier")  # '%999999999d' % 1
    return _BINARY[type(op)](a, b)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


# ---- reading what the program's process sent -----------------------------------------------------------------------

def outcomes_of(values: object, count: int) -> list[Any]:
    """The calls' outcomes from a frame's `values` (base64 of the JSON list the harness relayed): each call's
    value, or Failed. Anything malformed fails every call: the harness writes well-formed lists, so a malformed
    one was written by the program."""
    unreadable = [Failed("sent no readable result", "not_plain")] * count
    try:
        items = json.loads(binascii.a2b_base64(values)) if isinstance(values, str) else None
    except (ValueError, RecursionError, binascii.Error):  # RecursionError: a list nested past json's limit
        return unreadable
    if not isinstance(items, list) or len(items) != count:
        return unreadable
    return [_outcome(item) for item in items]


def _outcome(item: object) -> Any:
    if not (isinstance(item, dict) and len(item) in (1, 2)):
        return Failed("sent no readable result", "not_plain")
    detail = item.get("detail", item.get("error", item.get("nonplain")))
    detail = detail[:300] if isinstance(detail, str) else ""
    if "value" in item and len(item) == 1:
        try:
            return decode(item["value"])
        except NotPlain as error:
            return Failed(f"returned {error}, not plain data", "not_plain")
    if "nonplain" in item:
        return Failed(f"returned {detail}, not plain data", "not_plain")
    if "error" in item:
        return Failed(detail, "base_exception" if item.get("base") is True else None)
    if "exit" in item:
        return Failed(f"exited ({detail})", "exited_early")
    return Failed("sent no readable result", "not_plain")


def decode(wire: object, depth: int = 0) -> Any:
    """The plain value a wire value stands for (module docstring); NotPlain for anything else."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"a value nested over {MAX_DEPTH} deep")
    if wire is None or type(wire) in (bool, int, float, str):
        return wire
    if type(wire) is list:
        return [decode(item, depth + 1) for item in wire]
    if not (type(wire) is dict and len(wire) == 1):
        raise NotPlain("an unreadable value")
    (tag, body), = wire.items()
    if tag == "int" and isinstance(body, str) and _HEX_INT.fullmatch(body):
        return int(body, 16)
    if tag == "bytes" and isinstance(body, str):
        try:
            return bytes.fromhex(body)
        except ValueError:
            raise NotPlain("unreadable bytes") from None
    if tag not in ("tuple", "set", "frozenset", "dict") or type(body) is not list:
        raise NotPlain("an unreadable value")
    items = [decode(item, depth + 1) for item in body]
    try:
        if tag == "dict":
            if not all(type(pair) is list and len(pair) == 2 for pair in items):
                raise NotPlain("an unreadable dict")
            return {key: value for key, value in items}
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    except TypeError:  # an unhashable key or member
        raise NotPlain(f"an unreadable {tag}") from None
