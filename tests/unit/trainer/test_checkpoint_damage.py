"""Damaged checkpoints are named with the file and the fix, and a resume falls back to the newest intact one."""

import json
import re

import pytest
import torch

from flashreinforce.buffer import build_scheduler
from flashreinforce.models import build_model
from flashreinforce.trainer.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_states,
    newest_intact_checkpoint,
    open_checkpoint,
    save_checkpoint,
)
from flashreinforce.types import Prompt


def _save(directory, step, *, keep=3):
    """A checkpoint with the real shape of each state (a real model, a real scheduler's state, a ledger)."""
    model = build_model(vocab_size=12, hidden_size=16, num_layers=1, num_heads=2, max_position_embeddings=32)
    scheduler = build_scheduler("sync", prompt_at=lambda i: Prompt(id=f"p{i}", prompt="1+1?", ground_truth="2"),
                                batch_groups=2, group_size=2)
    optimizer = torch.optim.AdamW(model.parameters())
    return save_checkpoint(
        directory, step, write_model=model.save_pretrained,
        trainer_state={"version": step, "optimizer": optimizer.state_dict(), "schedule": {}, "torch_rng":
                       torch.get_rng_state()},
        controller_state={"version": step, "scheduler": scheduler.state_dict(), "inflight": []},
        meta={"wall_seconds": 1.0}, keep=keep)


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _drop_ledger(path):
    state = torch.load(path, weights_only=False)
    del state["scheduler"]["ledger"]
    torch.save(state, path)


DAMAGE = {
    "truncated weights": ("model/model.safetensors", _truncate, r"model/model\.safetensors is damaged or truncated"),
    "bad model config": ("model/config.json", lambda p: p.write_text("{nope"), r"model/config\.json is not valid JSON"),
    "truncated trainer state": ("trainer.pt", _truncate, r"trainer\.pt is unreadable"),
    "truncated controller state": ("controller.pt", _truncate, r"controller\.pt is unreadable"),
    "no ledger": ("controller.pt", _drop_ledger, r"controller\.pt lacks scheduler\.ledger"),
    "garbage meta": ("meta.json", lambda p: p.write_bytes(b"\x00\xffgarbage"), r"meta\.json is not valid JSON"),
    "meta not an object": ("meta.json", lambda p: p.write_text("[1, 2]"), r"meta\.json holds a list"),
}


def test_an_intact_checkpoint_opens_with_every_state(tmp_path):
    checkpoint = _save(tmp_path, 1)
    trainer_state, controller_state, meta = open_checkpoint(checkpoint)
    assert trainer_state["version"] == 1 and controller_state["inflight"] == [] and meta["step"] == 1
    assert newest_intact_checkpoint(tmp_path).skipped == []
    assert newest_intact_checkpoint(tmp_path / "none") is None  # no checkpoint yet: a fresh start, not an error


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_checkpoint_names_the_file_the_checkpoint_and_the_fix(tmp_path, kind):
    name, damage, reason = DAMAGE[kind]
    checkpoint = _save(tmp_path, 1)
    damage(checkpoint / name)
    with pytest.raises(CheckpointError, match=rf"checkpoint .*step_000001: {reason}.*; restore the checkpoint"):
        open_checkpoint(checkpoint)
    if name in ("trainer.pt", "controller.pt", "meta.json") and kind != "no ledger":
        with pytest.raises(ValueError, match=rf"step_000001: {reason}"):  # the plain loader names an unreadable file
            load_states(checkpoint)


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_resume_falls_back_to_the_newest_intact_checkpoint_and_keeps_the_damaged_one(tmp_path, kind):
    name, damage, reason = DAMAGE[kind]
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    damage(newest / name)
    damaged_bytes = (newest / name).read_bytes()

    found = newest_intact_checkpoint(tmp_path)  # read-only (eval): nothing is moved
    assert found.checkpoint.name == "step_000001" and found.meta["step"] == 1
    [(path, why)] = found.skipped
    assert path == newest and newest.is_dir() and re.match(reason, why)

    found = newest_intact_checkpoint(tmp_path, set_aside=True)  # a resume: the damaged one is renamed, not deleted
    aside = found.skipped[0][0]
    assert found.checkpoint.name == "step_000001" and aside.name == "step_000002.damaged"
    assert (aside / name).read_bytes() == damaged_bytes
    # The resumed run saves step 2 again and prunes to one checkpoint: the damaged copy survives both.
    _save(tmp_path, 2, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002"]
    assert (aside / name).read_bytes() == damaged_bytes
    open_checkpoint(tmp_path / "step_000002")


def test_every_checkpoint_damaged_is_an_error_naming_each_and_moves_nothing(tmp_path):
    for step in (1, 2):
        _truncate(_save(tmp_path, step) / "trainer.pt")
    (tmp_path / "step_000002" / "meta.json").write_text("not json")
    with pytest.raises(CheckpointError, match=r"checkpoints directory .*: no intact checkpoint \(step_000002: "
                                              r"trainer\.pt is unreadable.*; step_000001: trainer\.pt.*start a new run"):
        newest_intact_checkpoint(tmp_path, set_aside=True)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000001", "step_000002"]
    assert json.loads((tmp_path / "step_000001" / "meta.json").read_text())["step"] == 1
