"""`pip install -e '.[test]' && python -m pytest -q` (the README's test command, no extras) must pass: a test that
needs an extra skips, naming it. This walks every test module's imports and fails on an optional package, or a
package module that imports one when it is imported, reached without a skip guard:

- at module level: a `pytest.importorskip("<package>")` above it (the module is imported at collection, before
  any marker can skip it);
- inside a function: that, or the extra's marker (tests/conftest.py EXTRA_MARKERS) on the module (`pytestmark`),
  the test or its class, or an importorskip above it in the function.
"""

import ast
import re
import sys
from pathlib import Path

import pytest

from optional_extras import EXTRA_MARKERS, IMPORT_NAMES

TESTS = Path(__file__).resolve().parents[1]
PACKAGE = TESTS.parent / "flashreinforce"
MARKER_OF = {package: marker for marker, packages in EXTRA_MARKERS.items() for package in packages}


def _top_level_nodes(tree: ast.Module):
    """The statements that run when the module is imported: not function bodies, not `if TYPE_CHECKING:`."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module]
    return []


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def gated_modules() -> dict[str, str]:
    """Package modules whose import imports an optional package, directly or through another such module."""
    direct: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        names = {n for node in _top_level_nodes(ast.parse(path.read_text())) for n in _imported(node)}
        direct[_module_name(path)] = names
    gated = {module: MARKER_OF[name.split(".")[0]] for module, names in direct.items() for name in names
             if name.split(".")[0] in MARKER_OF}
    changed = True
    while changed:  # through package modules that import a gated one at module level
        changed = False
        for module, names in direct.items():
            reached = next((gated[n] for n in names if n in gated), None)
            if module not in gated and reached is not None:
                gated[module], changed = reached, True
    return gated


def _needs(name: str, gated: dict[str, str]) -> tuple[str, str] | None:
    """(the package to skip on, its extra's marker) that importing `name` requires, else None."""
    top = name.split(".")[0]
    if top in MARKER_OF:
        return top, MARKER_OF[top]
    if name in gated:
        marker = gated[name]
        return EXTRA_MARKERS[marker][0], marker
    return None


def _skips_on(node: ast.AST, package: str) -> bool:
    return (isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.importorskip" and bool(node.args)
            and isinstance(node.args[0], ast.Constant) and node.args[0].value == package)


def _marked(decorators: list[ast.expr], marker: str) -> bool:
    return any(re.search(rf"\bpytest\.mark\.{marker}\b", ast.unparse(d)) for d in decorators)


class _Walker(ast.NodeVisitor):
    """Every import of the module with the functions and classes around it."""

    def __init__(self, gated: dict[str, str]) -> None:
        self.gated, self.scopes, self.found, self.skips = gated, [], [], []

    def _scoped(self, node: ast.AST) -> None:
        self.scopes.append(node)
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Import(self, node: ast.AST) -> None:
        for name in _imported(node):
            needs = _needs(name, self.gated)
            if needs is not None:
                self.found.append((node, name, *needs, list(self.scopes)))

    visit_ImportFrom = visit_Import

    def visit_Call(self, node: ast.Call) -> None:
        """An importorskip of an extra's package: the test that reaches it must carry the extra's marker too,
        so that `-m <extra>` selects every test the extra unlocks (CI's second pass does)."""
        package = next((p for p in MARKER_OF if _skips_on(node, p)), None)
        if package is not None:
            self.skips.append((node, package, MARKER_OF[package], list(self.scopes)))
        self.generic_visit(node)


def _guarded(tree: ast.Module, node: ast.AST, package: str, marker: str, scopes: list[ast.AST]) -> bool:
    module_skip = any(_skips_on(n, package) and n.lineno < node.lineno
                      for stmt in tree.body if not isinstance(stmt, (ast.FunctionDef, ast.ClassDef))
                      for n in ast.walk(stmt))
    if module_skip or not scopes:
        return module_skip
    return _module_marked(tree, marker) or any(_marked(scope.decorator_list, marker) for scope in scopes) or any(
        _skips_on(n, package) and n.lineno < node.lineno for scope in scopes if not isinstance(scope, ast.ClassDef)
        for n in ast.walk(scope))


def _module_marked(tree: ast.Module, marker: str) -> bool:
    return any(isinstance(s, ast.Assign) and any(ast.unparse(t) == "pytestmark" for t in s.targets)
               and re.search(rf"\bpytest\.mark\.{marker}\b", ast.unparse(s.value)) for s in tree.body)


def unguarded(path: Path, gated: dict[str, str]) -> list[str]:
    tree = ast.parse(path.read_text())
    walker = _Walker(gated)
    walker.visit(tree)
    where = path.relative_to(TESTS.parent) if path.is_relative_to(TESTS.parent) else path
    problems = [f"{where}:{node.lineno} imports {name} (the {marker.replace('_', '-')} extra) "
                f"without pytest.importorskip({package!r}) or the {marker} marker"
                for node, name, package, marker, scopes in walker.found
                if not _guarded(tree, node, package, marker, scopes)]
    for node, package, marker, scopes in walker.skips:  # in a test, or at module level (fixtures and helpers
        # serve tests that carry the marker themselves)
        in_test = not scopes or scopes[0].name.lower().startswith("test")
        if in_test and not (_module_marked(tree, marker) or any(_marked(s.decorator_list, marker) for s in scopes)):
            problems.append(f"{where}:{node.lineno} skips without {package} but the test is not marked {marker} "
                            f"(add @pytest.mark.{marker}, or {marker} in the module's pytestmark)")
    return problems


def test_no_test_imports_an_optional_package_without_a_skip_guard():
    gated = gated_modules()
    assert "flashreinforce.controller.ray_backend" in gated  # the walk sees what it must
    problems = [p for path in sorted(TESTS.rglob("*.py")) for p in unguarded(path, gated)]
    assert problems == [], "\n".join(problems)


def test_the_walk_catches_an_unguarded_import(tmp_path):
    gated = gated_modules()
    cases = {
        "import peft\n": 1,
        "import pytest\npytest.importorskip('peft')\nimport peft\n": 1,  # the module's tests unmarked
        "import pytest\npytestmark = pytest.mark.lora\npytest.importorskip('peft')\nimport peft\n": 0,
        "import pytest\npytestmark = pytest.mark.lora\nimport peft\npytest.importorskip('peft')\n": 1,  # too late
        "from flashreinforce.controller.ray_backend import RayParts\n": 1,
        "import pytest\ndef test_a():\n    import ray\n": 1,
        "import pytest\n@pytest.mark.ray\ndef test_a():\n    import ray\n": 0,
        "import pytest\npytestmark = [pytest.mark.ray]\ndef test_a():\n    import ray\n": 0,
        "import pytest\ndef test_a():\n    pytest.importorskip('trl')\n    import trl\n": 1,  # unmarked
        "import pytest\n@pytest.mark.trl\ndef test_a():\n    pytest.importorskip('trl')\n    import trl\n": 0,

    }
    for n, (code, expected) in enumerate(cases.items()):
        path = tmp_path / f"case_{n}.py"
        path.write_text(code)
        assert len(unguarded(path, gated)) == expected, code


def test_every_optional_extra_has_a_marker_with_its_packages():
    tomllib = pytest.importorskip("tomllib") if sys.version_info < (3, 11) else __import__("tomllib")
    extras = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, requirements in extras.items():
        if extra in ("test", "dev"):  # the README's test command installs test; dev is tools no code imports
            continue
        names = [re.split(r"[<>=!~\[ ]", r)[0] for r in requirements if ";" not in r]
        packages = {IMPORT_NAMES.get(name, name.replace("-", "_")) for name in names}
        assert set(EXTRA_MARKERS.get(extra.replace("-", "_"), ())) == packages, extra
