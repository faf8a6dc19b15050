"""Builder tables: a config field names a kind, the table maps kinds to builders (ENGINES, BACKENDS)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

Builder = TypeVar("Builder", bound=Callable)


def pick_builder(table: Mapping[str, Builder], field: str, kind: str) -> Builder:
    """table[kind], or a ValueError naming the config field and the kinds this build has."""
    if kind not in table:
        raise ValueError(f"{field}={kind} is not available in this build yet; use one of {sorted(table)}")
    return table[kind]
