r"""Symbolic equality of two short math expressions with sympy, parsed safely.

Safety: a length cap; a character whitelist (letters, digits, + - * / ^ ( ) and decimal points, so
no attribute access, strings, indexing or dunders reach `parse_expr`'s eval); a namespace of a few
sympy names; a parse without evaluation whose tree is checked (size, constant exponents up to
MAX_EXPONENT) before anything is computed. Equality: identical canonical forms; a difference that is
an exact rational decides alone; else both sides agree to 1e-9 (relative) at three fixed generic
points, evaluated to 30 digits. No `simplify`, whose run time has no bound. sympy is imported on
first use: the arithmetic task never needs it.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

MAX_CHARS = 200
MAX_NODES = 300
MAX_EXPONENT = 1000
_TOLERANCE = 1e-9
# Generic points (away from 0, 1 and the integers) where a nonzero difference is very unlikely to vanish;
# positive, so logs and square roots stay real.
_POINTS = ((0.7183, 1.3137, 2.2361), (1.4142, 0.5772, 1.6180), (2.6458, 1.9021, 0.8660))
_ALLOWED = re.compile(r"[0-9A-Za-z+\-*/^().\s]+")
_LATEX_FUNCTIONS = ("sqrt", "sin", "cos", "tan", "ln", "log", "exp", "pi")


def symbolic_equal(a: str, b: str) -> bool:
    r"""Whether two expressions in up to three symbols are equal: "2(x+1)" vs "2x+2", "\sqrt{8}" vs "2\sqrt{2}".

    Anything that does not parse within the limits is not shown equal: False.
    """
    x, y = _parse(a), _parse(b)
    if x is None or y is None:
        return False
    if x == y:
        return True
    if (x - y).is_Rational:  # exact, e.g. 10^1000 vs 10^1000+1, which no tolerance would tell apart
        return False
    symbols = sorted(x.free_symbols | y.free_symbols, key=str)
    if len(symbols) > len(_POINTS[0]):
        return False
    for point in _POINTS:
        values = dict(zip(symbols, point))
        if not _close(_value(x, values), _value(y, values)):
            return False
    return True


def _value(expr: Any, values: dict) -> Any:
    """expr at a point to 30 digits (a sympy number, so 10^1000 does not overflow), or None if not finite."""
    try:
        value = expr.evalf(30, subs=values)
    except Exception:  # noqa: BLE001 - see _parse: sympy's many exception types all mean "no value here"
        return None
    return value if value.is_number and value.is_finite else None


def _close(u: Any, v: Any) -> bool:
    if u is None or v is None:
        return False
    return bool(abs(u - v) <= _TOLERANCE * max(1, abs(v)))


def _parse(text: str) -> Any:
    """A sympy expression, or None when the text is too big, not in the whitelist or not an expression."""
    if len(text) > 4 * MAX_CHARS:  # before the LaTeX rewrite, whose time grows with the square of the length
        return None
    text = _from_latex(text)
    if text is None or len(text) > MAX_CHARS or not _ALLOWED.fullmatch(text):
        return None
    if "__" in text or re.search(r"\.(?!\d)", text):  # a dot only as a decimal point
        return None
    sympy, parser = _sympy()
    kwargs = {"transformations": parser.standard_transformations + (parser.implicit_multiplication,
                                                                    parser.convert_xor),
              "global_dict": _namespace(), "local_dict": {}}
    # sympy raises a zoo of exception types on malformed input (SyntaxError, TypeError, TokenError,
    # SympifyError, ...); each of them only means "not an expression we can compare".
    try:
        tree = parser.parse_expr(text, evaluate=False, **kwargs)
        if not isinstance(tree, sympy.Expr) or not _small(tree, sympy):
            return None
        expr = parser.parse_expr(text, **kwargs)
    except Exception:  # noqa: BLE001 - not an expression we can compare (above)
        return None
    # Division by zero evaluates to zoo or nan, which would compare equal to any other undefined value.
    return None if expr.has(sympy.zoo, sympy.nan) else expr


def _small(tree: Any, sympy: Any) -> bool:
    """At most MAX_NODES nodes, and no constant exponent above MAX_EXPONENT (9^9^9 would be computed exactly)."""
    nodes = list(sympy.preorder_traversal(tree))
    if len(nodes) > MAX_NODES:
        return False
    for node in nodes:
        # A float estimate is cheap even for a tower; `not <=` also refuses NaN.
        if (isinstance(node, sympy.Pow) and not node.exp.free_symbols
                and not abs(complex(node.exp.evalf(15))) <= MAX_EXPONENT):
            return False
    return True


def _from_latex(text: str) -> str | None:
    r"""Plain syntax for the LaTeX of final answers (\frac, \sqrt, \cdot, \pi, braces); None if others remain."""
    text = text.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    text = text.replace(r"\cdot", "*").replace(r"\times", "*").replace(r"\div", "/")
    text = _replace_command(text, r"\frac", 2, "(({0})/({1}))")
    text = re.sub(r"\\sqrt\[([^\[\]]+)\]\{", r"\\root{\1}{", text)
    text = _replace_command(text, r"\root", 2, "(({1})**(1/({0})))")
    text = _replace_command(text, r"\sqrt", 1, "sqrt({0})")
    for name in _LATEX_FUNCTIONS:
        text = re.sub(rf"\\{name}(?![A-Za-z])", name, text)
    text = text.replace(r"\infty", "oo").replace("{", "(").replace("}", ")")
    return None if "\\" in text else text


def _replace_command(text: str, command: str, arity: int, template: str) -> str:
    """Rewrite every `command{a}{b}` (arguments with nested braces) with template.format(a, b)."""
    while (start := text.find(command + "{")) >= 0:
        args, i = [], start + len(command)
        for _ in range(arity):
            if i >= len(text) or text[i] != "{":
                return text  # malformed: leave the backslash, so the caller rejects it
            depth, j = 0, i
            while j < len(text):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    break
                j += 1
            if depth:
                return text
            args.append(text[i + 1:j])
            i = j + 1
        text = text[:start] + template.format(*args) + text[i:]
    return text


@cache
def _sympy() -> tuple[Any, Any]:
    import sympy
    from sympy.parsing import sympy_parser

    return sympy, sympy_parser


def _namespace() -> dict[str, Any]:
    """The only names parsed text can reach (fresh per parse: parse_expr may write into it)."""
    sympy, _ = _sympy()
    names = ("Symbol", "Function", "Integer", "Float", "Rational", "Add", "Mul", "Pow",
             "sqrt", "exp", "log", "sin", "cos", "tan", "pi", "E", "oo")
    return {"__builtins__": {}, "ln": sympy.log, **{name: getattr(sympy, name) for name in names}}
