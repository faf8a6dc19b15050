"""Atomic, step-stamped checkpoints: write into a temporary directory, fsync, rename.

A checkpoint directory `step_000040/` holds:
  model/          Hugging Face format (safetensors + config + tokenizer): `from_pretrained` loads it; with
                  trainer.lora the merged model, and model/adapter/ the adapter alone (peft format)
  trainer.pt      optimizer, lr schedule, policy version, RNG states; with trainer.lora the adapter and the
                  frozen base of its layers, which a resume restores (trainer/lora.py says why)
  controller.pt   scheduler/buffer state with the exactly-once ledger, in-flight partial rollouts, counters
  meta.json       step and wall time
A process killed at any moment leaves either the previous checkpoint or the new one, never a torn one: the
directory only gets its final name after every byte is on disk, and loaders ignore `*.tmp*` directories.

A checkpoint damaged afterwards (a truncated copy, a disk error) is reported as a CheckpointError naming the
file; a resume (newest_intact_checkpoint) skips it for the newest intact one and keeps it, renamed
`step_N.damaged`, so that nothing written is deleted and pruning no longer counts it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from flashreinforce.models.causal_lm import model_dir_problem

CHECKPOINT_PATTERN = re.compile(r"^step_(\d{6,})$")

# What a resume reads (cli/train.py, Trainer.load_state_dict, RLLoop.restore, buffer/book.py scheduler_state):
# a checkpoint without one of these cannot be resumed from, so it is rejected before any of it is used.
RESUME_KEYS = {
    "trainer.pt": ("version", "optimizer", "schedule", "torch_rng"),
    "controller.pt": ("version", "scheduler", "inflight"),
    "meta.json": ("step", "wall_seconds"),
}
SCHEDULER_KEYS = ("kind", "options", "book", "ledger")
_FIX = ("restore the checkpoint from a backup, or resume from an older one (`train --resume` skips damaged "
        "checkpoints by itself)")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded. `reason` names the file and the problem; the message adds the
    checkpoint and what to do. A ValueError, so the CLI prints it as one error line, not a traceback."""

    def __init__(self, checkpoint: Path, reason: str, fix: str = _FIX, *, label: str = "checkpoint") -> None:
        super().__init__(f"{label} {checkpoint}: {reason}; {fix}")
        self.checkpoint = checkpoint
        self.reason = reason


class Resumable(NamedTuple):
    checkpoint: Path
    trainer_state: dict[str, Any]
    controller_state: dict[str, Any]
    meta: dict[str, Any]
    skipped: list[tuple[Path, str]]
    """(where the damaged checkpoint is now, why it was skipped) for each newer one that was damaged."""


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
        raise CheckpointError(checkpoint, f"incomplete, {', '.join(missing)} missing",
                              "pass a run directory or a complete checkpoints/step_* directory")
    trainer_state = _load_torch(checkpoint, "trainer.pt")
    controller_state = _load_torch(checkpoint, "controller.pt")
    try:
        meta = json.loads((checkpoint / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # ValueError: bad JSON or bad UTF-8
        raise CheckpointError(checkpoint, f"meta.json is not valid JSON ({_first_line(error)})") from error
    if not isinstance(meta, dict):
        raise CheckpointError(checkpoint, f"meta.json holds a {type(meta).__name__}, not a JSON object")
    return trainer_state, controller_state, meta


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def _load_torch(checkpoint: Path, name: str) -> dict[str, Any]:
    try:
        state = torch.load(checkpoint / name, weights_only=False)
    except MemoryError:  # the machine's problem, not the file's: an intact checkpoint must not be skipped for it
        raise
    except Exception as error:  # a torn or overwritten file fails in many ways: zip reader, unpickler, EOF
        raise CheckpointError(checkpoint, f"{name} is unreadable ({_first_line(error)})") from error
    if not isinstance(state, dict):
        raise CheckpointError(checkpoint, f"{name} holds a {type(state).__name__}, not a state dict")
    return state


def open_checkpoint(checkpoint: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """load_states, after checking everything a resume reads: the model files and the keys of each state.

    All checked up front, so a damaged checkpoint is reported (and can be skipped) before any of it is used,
    rather than failing with a traceback halfway through building the run.
    """
    states = load_states(checkpoint)
    problem = model_dir_problem(checkpoint / "model")
    if problem is not None:
        file, what = problem
        raise CheckpointError(checkpoint, f"{file.relative_to(checkpoint)} {what}")
    for name, state in zip(RESUME_KEYS, states):
        absent = [key for key in RESUME_KEYS[name] if key not in state]
        if absent:
            raise CheckpointError(checkpoint, f"{name} lacks {', '.join(absent)} (written by another version, "
                                              "or damaged)")
    scheduler = states[1]["scheduler"]
    absent = [key for key in SCHEDULER_KEYS if not isinstance(scheduler, dict) or key not in scheduler]
    if absent:
        raise CheckpointError(checkpoint, f"controller.pt lacks scheduler.{', scheduler.'.join(absent)} (the "
                                          "scheduler state with the exactly-once ledger)")
    return states


def newest_intact_checkpoint(directory: Path, *, set_aside: bool = False) -> Resumable | None:
    """The newest checkpoint under `directory` that open_checkpoint accepts, with its states; None if none exist.

    Damaged ones are tried newest first and listed in `skipped`, so the caller can say what it skipped. They are
    never deleted. With `set_aside` (a resume, which goes on to write checkpoints) each is renamed
    `step_N.damaged`: no longer a checkpoint name, so pruning does not count it and re-saving step N does not
    replace it. If every checkpoint is damaged this raises: starting over would silently retrain from scratch.
    """
    skipped: list[tuple[Path, str]] = []
    for checkpoint in reversed(list_checkpoints(directory)):
        try:
            states = open_checkpoint(checkpoint)
        except CheckpointError as error:
            skipped.append((checkpoint, error.reason))
            continue
        if set_aside:
            skipped = [(_set_aside(path), reason) for path, reason in skipped]
        return Resumable(checkpoint, *states, skipped)
    if skipped:
        reasons = "; ".join(f"{path.name}: {reason}" for path, reason in skipped)
        raise CheckpointError(directory, f"no intact checkpoint ({reasons})",
                              "restore one from a backup, or start a new run with another --output",
                              label="checkpoints directory")
    return None


def _set_aside(checkpoint: Path) -> Path:
    """Rename a damaged checkpoint out of the checkpoint namespace (step_N.damaged, .damaged2, ...)."""
    count = 1
    while (aside := checkpoint.with_name(f"{checkpoint.name}.damaged{count if count > 1 else ''}")).exists():
        count += 1
    os.replace(checkpoint, aside)
    return aside
