"""The user's own Python files (reward functions, environments, agents) imported as modules by path."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_file(path: Path, kind: str) -> ModuleType:
    """`path` (an existing .py file) as a module, imported once per resolved path.

    The module's name is unique to the path, so two user files both called rewards.py do not replace each other;
    it is registered before the file runs (dataclasses and pickle look a module up by name while it executes) and
    removed again if running it fails, so a fixed file imports afresh. `kind` names what the file is, in the
    module's name (e.g. `reward`). Errors from the file itself propagate for the caller to word.
    """
    path = path.resolve()
    module_name = f"_flashreinforce_{kind}_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
