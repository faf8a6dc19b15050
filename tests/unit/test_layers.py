"""docs/development.md "Layers": imports point one way, and heavy or optional packages stay in their corner."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "flashreinforce"

# Lower rank = lower layer. A module may import its own layer and the layers below it, never above.
RANK = {
    "types": 0, "lifetime": 0, "user_code": 0, "algorithms": 1, "sandbox": 1, "models": 2, "rollout": 3, "data": 4, "envs": 4,
    "endpoint": 4, "verifiers": 5, "buffer": 6,
    "trainer": 7, "controller": 8, "eval": 9, "metrics": 9, "config": 9, "run": 10, "cli": 11, "__init__": 11,
    "__main__": 11,
}
# Siblings that must not see each other even though their ranks would allow it.
FORBIDDEN = {("buffer", "verifiers"), ("buffer", "envs"), ("buffer", "data"), ("buffer", "rollout"),
             ("buffer", "models"), ("buffer", "algorithms"), ("verifiers", "envs"), ("verifiers", "rollout"),
             ("data", "verifiers"), ("endpoint", "envs"), ("endpoint", "data"), ("buffer", "endpoint"),
             ("verifiers", "endpoint")}
# verifiers may use models (a reward model loads like any model), but only where a verifier is built:
# test_light_imports keeps the pool, its workers and the registry free of torch.
MODULE_EXCEPTIONS = {"verifiers/judge.py": {"rollout"}}
"""Modules allowed a sibling the rest of their layer may not import. The judge is a verifier that generates: it runs
its model through the embedded engine (judges are verifiers, which sit above rollout), importing it lazily
inside its factory so that the pool and its workers stay light."""


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        yield path, parts[0]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_every_package_module_has_a_layer():
    assert {layer for _, layer in _modules()} <= set(RANK)


@pytest.mark.parametrize(("path", "layer"), list(_modules()), ids=lambda v: str(v).split("flashreinforce/")[-1])
def test_imports_point_down_the_layers(path, layer):
    for name in _imports(path):
        parts = name.split(".")
        if parts[0] != "flashreinforce" or len(parts) == 1:
            continue
        target = parts[1]
        assert RANK[target] <= RANK[layer], f"{layer} must not import {name} (a higher layer)"
        allowed = MODULE_EXCEPTIONS.get(path.relative_to(PACKAGE).as_posix(), set())
        assert (layer, target) not in FORBIDDEN or target in allowed, f"{layer} must not import its sibling {name}"


@pytest.mark.parametrize(("path", "layer"), list(_modules()), ids=lambda v: str(v).split("flashreinforce/")[-1])
def test_optional_packages_stay_in_their_corner(path, layer):
    names = {n.split(".")[0] for n in _imports(path)}
    if RANK[layer] < RANK["controller"]:
        assert "ray" not in names, "nothing below the controller imports ray"
    if not path.name.startswith("vllm"):
        assert "vllm" not in names, "only the vLLM engine adapter imports vllm"


def test_light_imports_stay_light():
    """`import flashreinforce`, the plotting module and a math verifier's worker pull in no torch (nor do the model
    verifiers' modules until one is built)."""
    code = ("import sys, flashreinforce, flashreinforce.metrics.plots, flashreinforce.types, "
            "flashreinforce.config, flashreinforce.verifiers.worker, flashreinforce.verifiers.pool, "
            "flashreinforce.verifiers.judge, flashreinforce.verifiers.reward_model; "
            "from flashreinforce.verifiers.rewards import load_reward_fn; load_reward_fn('math'); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_run_layers_lazy_exports_are_its_all():
    """run/__init__.py names its exports twice: in __all__ (read by tools) and in the lazy-import table."""
    from flashreinforce import run

    assert sorted(run.__all__) == sorted(run._EXPORTS)


def test_the_trainer_imports_no_pyplot_until_a_plot():
    """pyplot costs ~0.5 s to import, in every rank and run process; only drawing a plot may import matplotlib."""
    code = ("import sys, flashreinforce.run.training, flashreinforce.run.stages, flashreinforce.cli; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


CLI_MAY_IMPORT = ("flashreinforce.config", "flashreinforce.run", "flashreinforce.metrics.plots")


def test_the_cli_only_parses_arguments_and_calls_the_run_layer():
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        for name in _imports(path):
            if name.startswith("flashreinforce"):
                assert name.startswith(CLI_MAY_IMPORT), f"cli/{path.name} imports {name}: assembly belongs in run/"


def _function_lengths():
    """(where, lines) of every function in the package, its docstring not counted."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = node.body[0]
                docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str)
                lines = node.end_lineno - node.lineno + 1 - ((first.end_lineno - first.lineno + 1) if docstring else 0)
                yield f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}", lines


def test_no_function_is_over_80_lines():
    long = {where: lines for where, lines in _function_lengths() if lines > 80}
    assert not long, f"split these into functions with one job each: {long}"


def _module_graph() -> dict[str, set[str]]:
    """flashreinforce module -> the flashreinforce modules it imports (anywhere in its body)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("flashreinforce", *path.relative_to(PACKAGE).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def test_no_two_modules_import_each_other_even_through_others():
    graph, done, cycles = _module_graph(), set(), []

    def visit(name: str, path: list[str]) -> None:
        for target in sorted(graph[name]):
            if target in path:
                cycles.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in done:
                visit(target, [*path, target])
        done.add(name)

    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    assert not cycles, f"import circles: {cycles}"
