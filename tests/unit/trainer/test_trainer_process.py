"""TrainerProcess: the same steps as an inline Trainer, its errors raised here, its death detected."""

import dataclasses
import os
import signal

import pytest
import torch

from flashreinforce.models import build_model
from flashreinforce.trainer.process import TrainerProcess, TrainerProcessError
from flashreinforce.trainer.trainer import OptimizerSettings, Trainer
from flashreinforce.types import FORCED_VERSION, Prompt, RolloutKey, Trajectory, Verdict

VOCAB = 12


def tiny_trainer(model: torch.nn.Module) -> Trainer:
    """The factory the child runs (module level, so it is importable there by name)."""
    torch.manual_seed(0)
    return Trainer(
        model,
        loss="flashreinforce",
        loss_options={},
        optimizer=OptimizerSettings(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=0,
                                    total_steps=10, min_lr_ratio=1.0, grad_clip=1.0),
        microbatch_size=4,
        pad_token_id=0,
        temperature=1.0,
        max_new_tokens=8,
    )


def broken_trainer(model: torch.nn.Module) -> Trainer:
    raise ValueError("trainer.lr: this factory refuses to build")


def batch(seed: int) -> list[Trajectory]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(6):
        n = 3 + int(torch.randint(0, 5, (1,), generator=g))
        tokens = tuple(int(t) for t in torch.randint(1, VOCAB, (n,), generator=g))
        mask = tuple(int(j >= 2) for j in range(n))
        reward = float(i % 2)
        rows.append(Trajectory(
            key=RolloutKey(f"p{i}", 0), prompt=Prompt(id=f"p{i}", prompt="x", ground_truth="1"), group=i,
            tokens=tokens, loss_mask=mask, behavior_logprobs=tuple(-2.0 * m for m in mask),
            policy_versions=tuple(0 if m else FORCED_VERSION for m in mask), prompt_length=2,
            finish_reason="stop", verdict=Verdict(reward=reward, passed=reward > 0)))
    return rows


def model() -> torch.nn.Module:
    return build_model(VOCAB, 16, 1, 2, 32, seed=3)


class SharedChild:
    """One started child of `tiny_trainer` for the module: starting one costs a fresh interpreter that imports
    torch and transformers (~3 s), more than any test here spends in it. `get(fresh=True)` gives a child no
    test has used yet (the shared one when untouched, else a new one); `take()` hands the shared child over
    for good (a test that kills it), so no later test sees it."""

    def __init__(self) -> None:
        self.remote: TrainerProcess | None = None
        self.used = False
        self.extra: list[TrainerProcess] = []

    def _start(self) -> TrainerProcess:
        return TrainerProcess(tiny_trainer, (model(),), threads=1)

    def get(self, fresh: bool = False) -> TrainerProcess:
        if self.remote is not None and fresh and self.used:
            self.extra.append(self._start())
            return self.extra[-1]
        if self.remote is None:
            self.remote, self.used = self._start(), False
        self.used = True
        return self.remote

    def take(self) -> TrainerProcess:
        remote, self.remote = (self.remote or self._start()), None
        self.extra.append(remote)
        return remote

    def close(self) -> None:
        for remote in [self.remote, *self.extra]:
            if remote is not None:
                remote.close()


@pytest.fixture(scope="module")
def children():
    shared = SharedChild()  # built in this (the main) thread: the child dies with the thread that built it
    yield shared
    shared.close()


@pytest.mark.slow  # a trainer process of its own (~5 s to start)
def test_steps_match_an_inline_trainer_and_weights_are_published(children, one_thread, tmp_path):
    inline = tiny_trainer(model())
    remote = children.get(fresh=True)  # unstepped: the same weights and optimizer as `inline`
    assert remote.version == 0
    for step in range(3):
        expected = inline.step(batch(step))
        got = remote.step(batch(step))
        assert remote.version == inline.version == step + 1
        assert got.keys() == expected.keys()
        assert got["loss/policy"] == pytest.approx(expected["loss/policy"], rel=1e-6, abs=1e-9)
        published = remote.weights()
        for name, tensor in inline.weights().items():
            torch.testing.assert_close(published[name], tensor, rtol=1e-6, atol=1e-7)
    # optimizer state and version round-trip through the pipe
    state = remote.state_dict()
    assert state["version"] == 3
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], inline.state_dict()["optimizer"]["state"][0]["exp_avg"])
    remote.save_model(tmp_path / "model")
    saved = type(inline.model).from_pretrained(tmp_path / "model")
    for name, tensor in saved.state_dict().items():
        torch.testing.assert_close(tensor, remote.weights()[name])


@pytest.mark.slow  # a trainer process of its own (~5 s to start)
def test_load_state_dict_restores_version_and_optimizer(children, one_thread):
    source = tiny_trainer(model())
    source.step(batch(0))
    remote = children.get()  # a used child too: the load replaces whatever version and state it had
    remote.load_state_dict(source.state_dict())
    assert remote.version == 1
    assert remote.state_dict()["schedule"] == source.state_dict()["schedule"]


@pytest.mark.slow  # a trainer process of its own (~5 s to start)
def test_an_error_in_the_child_is_raised_here_with_its_traceback(children):
    with pytest.raises(ValueError, match="this factory refuses") as caught:
        TrainerProcess(broken_trainer, (model(),), threads=1)
    assert any("trainer process" in note and "broken_trainer" in note for note in caught.value.__notes__)

    remote = children.get()
    remote.load_state_dict(tiny_trainer(model()).state_dict())  # back to version 0 and a fresh optimizer
    row = batch(0)[0]
    with pytest.raises(ValueError, match="no sampled tokens") as caught:  # the trainer's own check
        remote.step([dataclasses.replace(row, loss_mask=(0,) * len(row.tokens))])
    assert any("'step'" in note for note in caught.value.__notes__)
    remote.step(batch(1))  # the child survives a refused batch
    assert remote.version == 1


@pytest.mark.slow  # a trainer process of its own (~5 s to start)
def test_a_dead_child_is_reported_with_its_exit_code(children):
    remote = children.take()  # killed here: no later test gets this child
    try:
        os.kill(remote._proc.pid, signal.SIGKILL)
        with pytest.raises(TrainerProcessError, match=r"code -9"):
            remote.step(batch(0))
    finally:
        remote.close()
    remote.close()  # twice is fine
    with pytest.raises(TrainerProcessError, match="closed"):
        remote.state_dict()


def test_the_shared_weights_go_where_there_is_room(monkeypatch, tmp_path):
    from flashreinforce.trainer import process

    class Full:
        f_bavail, f_frsize = 0, 4096

    class Roomy:
        f_bavail, f_frsize = 10**6, 4096

    monkeypatch.setattr(process.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(process.os, "statvfs", lambda d: Full if d == "/dev/shm" else Roomy)
    assert process._weights_dir(2**20) == str(tmp_path)  # a capped /dev/shm (containers: 64 MB) is skipped
    monkeypatch.setattr(process.os, "statvfs", lambda d: Full)
    with pytest.raises(TrainerProcessError, match="backend.trainer_process=false"):
        process._weights_dir(2**20)
