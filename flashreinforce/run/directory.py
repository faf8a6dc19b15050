"""A run directory: where a run's files live, and the writes that must survive a kill.

    config.yaml         the resolved config (what --resume and `flashreinforce eval` read back)
    metrics.jsonl, samples.jsonl, tensorboard/, plots/   (metrics/)
    sft/                the warm-start model, once complete
    initial_eval.json   the held-out score before RL;  pass_initial.json  AHRL's pass@k per prompt
    checkpoints/        step_* (trainer/checkpoint.py)
    summary.json        what the run achieved
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from flashreinforce.config import RunConfig, dump_config


def default_run_dir(config: RunConfig) -> Path:
    return Path("runs") / f"{config.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def create_run_dir(config: RunConfig, run_dir: Path | None) -> Path:
    """A new run directory holding config.yaml; refuses one that already holds a run."""
    run_dir = run_dir or default_run_dir(config)
    if (run_dir / "checkpoints").exists():
        raise ValueError(f"{run_dir} already holds a run; pass --resume {run_dir} to continue it, "
                         "or choose another --output")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))
    return run_dir


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """The YAML tree of a run's config.yaml, or a ValueError naming the file and the fix."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ValueError(f"{run_dir} is not a run directory (no config.yaml); pass the --output of an earlier run")
    fix = "restore it from a backup, or rewrite it (`flashreinforce train RECIPE --dry-run` prints a resolved config)"
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} (the run's resolved config) is not valid YAML ({' '.join(str(error).split())}); "
                         f"{fix}") from None
    if not isinstance(tree, dict):
        raise ValueError(f"{path} (the run's resolved config) holds a {type(tree).__name__}, not a mapping of "
                         f"sections; {fix}")
    return tree


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Readers see the old file or the new one, never a torn one."""
    staging = path.with_suffix(path.suffix + ".tmp")
    staging.write_text(json.dumps(payload, indent=2))
    os.replace(staging, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file this run wrote earlier (resume), or None if it is not there yet."""
    return json.loads(path.read_text()) if path.exists() else None
