"""Atomic, step-stamped checkpoints: write into a temporary directory, fsync, rename.

A checkpoint directory `step_000040/` holds:
  model/          Hugging Face format (safetensors + config + tokenizer): `from_pretrained` loads it
  trainer.pt      optimizer, lr schedule, policy version, RNG states
  controller.pt   scheduler/buffer state with the exactly-once ledger, in-flight partial rollouts, counters
  meta.json       step and wall time
A process killed at any moment leaves either the previous checkpoint or the new one, never a torn one: the
directory only gets its final name after every byte is on disk, and loaders ignore `*.tmp*` directories.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_PATTERN = re.compile(r"^step_(\d{6,})$")


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    for directory in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def save_checkpoint(
    directory: Path,
    step: int,
    *,
    write_model: Callable[[Path], None],
    trainer_state: dict[str, Any],
    controller_state: dict[str, Any],
    meta: dict[str, Any],
    keep: int,
) -> Path:
    """Write checkpoint `step` under `directory` atomically; prune all but the newest `keep`.

    `write_model(path)` writes the model and tokenizer in Hugging Face format into `path`.
    """
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step_{step:06d}"
    for leftover in directory.glob("step_*.tmp*"):  # torn writes of a process killed mid-save
        shutil.rmtree(leftover)
    staging = directory / f"step_{step:06d}.tmp{os.getpid()}"
    staging.mkdir()
    write_model(staging / "model")
    torch.save(trainer_state, staging / "trainer.pt")
    torch.save(controller_state, staging / "controller.pt")
    (staging / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=2))
    _fsync_tree(staging)
    if final.exists():  # re-saving the same step after a resume: replace it whole
        shutil.rmtree(final)
    os.replace(staging, final)
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    for old in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(old)
    return final


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first. Leftover staging directories are ignored."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and CHECKPOINT_PATTERN.match(p.name)]
    return sorted(found, key=lambda p: int(CHECKPOINT_PATTERN.match(p.name).group(1)))


def latest_checkpoint(directory: Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def load_states(checkpoint: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(trainer_state, controller_state, meta) of a checkpoint directory, with errors that say what is wrong."""
    missing = [name for name in ("model", "trainer.pt", "controller.pt", "meta.json") if not (checkpoint / name).exists()]
    if missing:
        raise ValueError(f"checkpoint {checkpoint} is incomplete (missing {', '.join(missing)}); "
                         "pass a run directory or a complete checkpoints/step_* directory")
    trainer_state = torch.load(checkpoint / "trainer.pt", weights_only=False)
    controller_state = torch.load(checkpoint / "controller.pt", weights_only=False)
    meta = json.loads((checkpoint / "meta.json").read_text())
    return trainer_state, controller_state, meta
