"""A data-parallel rank on GPUs selects its own GPU before its first collective (CUDA mocked: no GPU here).

Without torch.cuda.set_device(rank), NCCL's object collectives (all_gather_object) stage every rank's tensors
on GPU 0: NCCL rejects that or hangs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flashreinforce.trainer.distributed import RankGroup, Shard, join_group


@pytest.fixture
def calls(monkeypatch) -> list[tuple]:
    """torch.cuda and torch.distributed stand-ins for a machine with 4 GPUs, recording their calls in order."""
    recorded: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: recorded.append(("set_device", torch.device(device))))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: recorded.append(("init", backend)))
    monkeypatch.setattr(dist, "TCPStore", lambda *args, **kwargs: recorded.append(("store",)))
    monkeypatch.setattr(dist, "all_gather_object", lambda out, value: recorded.append(("all_gather_object",)))
    return recorded


@pytest.mark.parametrize("launcher_store", [False, True])
@pytest.mark.parametrize("rank", [0, 1, 3])
def test_an_nccl_rank_selects_its_gpu_before_its_first_collective(calls, rank, launcher_store):
    join_group(RankGroup(rank, 4, "tcp://127.0.0.1:29500", "nccl", launcher_store=launcher_store))
    Shard(rank, 4).gather({"loss": 1.0})
    collectives = [c for c in calls if c[0] in ("init", "all_gather_object")]
    assert ("set_device", torch.device("cuda", rank)) in calls, calls
    assert calls.index(("set_device", torch.device("cuda", rank))) < calls.index(collectives[0]), calls


def test_a_rank_that_sees_one_gpu_takes_that_one(calls, monkeypatch):
    """A Ray trainer actor sees only the GPU Ray gave it: rank 1 computes on its cuda:0."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    join_group(RankGroup(1, 2, "tcp://127.0.0.1:29500", "nccl"))
    assert calls[:2] == [("set_device", torch.device("cuda", 0)), ("init", "nccl")]


def test_a_gloo_rank_leaves_the_cuda_device_alone(calls):
    join_group(RankGroup(1, 2, "tcp://127.0.0.1:29500", "gloo"))
    assert calls == [("init", "gloo")]
