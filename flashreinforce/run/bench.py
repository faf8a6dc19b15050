"""`flashreinforce bench NAME`: the benchmark scripts of a source checkout, by name."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def find_benchmark(name: str) -> Path:
    """benchmarks/NAME.py (dashes for underscores): a script there that runs as __main__ (its helper modules
    do not)."""
    scripts = sorted(BENCHMARKS_DIR.glob("*.py")) if BENCHMARKS_DIR.is_dir() else []
    runnable = {p.stem.replace("_", "-"): p for p in scripts if 'if __name__ == "__main__":' in p.read_text()}
    if name not in runnable:
        known = sorted(runnable)
        raise ValueError(f"no benchmark {name!r}" + (f"; available: {', '.join(known)}" if known else
                         " (benchmarks ship with a source checkout, not the installed package)"))
    return runnable[name]
