"""Data-parallel training over torch.distributed: which rows a rank trains, and what the ranks exchange.

Every rank receives the WHOLE learner batch and computes its advantages, reward mean, B and token count
itself (normalization is global, never per shard). A rank then trains only its rows:
the length-sorted batch dealt out round-robin (rank r takes rows r, r + W, r + 2W, ...), so each rank gets
rows of every length and the ranks finish their backward passes at about the same time. Each microbatch's
loss is already divided by the global B and T, so the sum of the ranks' gradients (one all-reduce) is the
gradient of the whole batch: the optimizer step, the clip and the weights are the same on every rank and the
same as one process would compute, up to float rounding of the sum's order.

torch.distributed is joined once per process (`join_group`): gloo on CPU, NCCL on GPU. A process that never
joined trains as the only rank.
"""

from __future__ import annotations

import datetime
from urllib.parse import urlparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class RankGroup:
    """Where one rank of the trainer group meets the others."""

    rank: int
    world_size: int
    init_method: str
    """torch.distributed rendezvous tcp://host:port: rank 0 listens there (the address of rank 0's machine and a
    free port), unless `launcher_store`."""
    backend: Literal["gloo", "nccl"] = "gloo"
    launcher_store: bool = False
    """The launcher already listens at init_method (a TCPStore it made on port 0, so no other process can take
    the port between its choice and rank 0's bind); every rank, rank 0 too, connects to it."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of world_size {self.world_size}")


def join_group(group: RankGroup, timeout_s: float = 300.0) -> None:
    """Join the trainer's process group (blocks until all world_size ranks have joined, or times out).

    An NCCL rank first makes its own GPU the current one: NCCL's object collectives (all_gather_object) stage
    on the current device, which is GPU 0 in every process that did not choose, and NCCL rejects or hangs on
    ranks that share a GPU."""
    if dist.is_initialized():
        raise RuntimeError("this process already joined a torch.distributed group; one trainer rank per process")
    if group.backend == "nccl":
        torch.cuda.set_device(rank_gpu(group.rank))
    timeout = datetime.timedelta(seconds=timeout_s)
    if not group.launcher_store:
        dist.init_process_group(group.backend, init_method=group.init_method, rank=group.rank,
                                world_size=group.world_size, timeout=timeout)
        return
    address = urlparse(group.init_method)
    store = dist.TCPStore(address.hostname, address.port, is_master=False, timeout=timeout)
    dist.init_process_group(group.backend, store=store, rank=group.rank, world_size=group.world_size,
                            timeout=timeout)


def rank_gpu(rank: int) -> torch.device:
    """The GPU a rank computes on: GPU `rank` of those visible, modulo their count (the one GPU a Ray actor
    sees). run/devices.py's resolve_device gives its trainer the same one."""
    return torch.device("cuda", rank % torch.cuda.device_count())


def launcher_store(host: str = "127.0.0.1") -> tuple[dist.TCPStore, str]:
    """A rendezvous store the launcher holds open for its ranks (RankGroup.launcher_store), on a port the OS
    picks as it binds; returns (store, its tcp:// address). Keep the store alive as long as the group."""
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    return store, f"tcp://{host}:{store.port}"


@dataclass(frozen=True)
class Shard:
    """This process's place in the trainer group (rank 0 of 1 without torch.distributed)."""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def current(cls) -> Shard:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def rows(self, num_rows: int) -> torch.Tensor:
        """Indices of the rows of a (length-sorted) batch this rank trains: round-robin over the ranks; none for
        a rank past the batch's last row (a batch smaller than the group, e.g. after dynamic sampling)."""
        return torch.arange(min(self.rank, num_rows), num_rows, self.world_size)

    def sum_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Every rank's `.grad` := the sum over ranks (a rank without rows contributes zeros), in one
        flattened all-reduce so the cost is one collective per step, not one per tensor."""
        if self.world_size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for param, grad in zip(params, grads):
            param.grad = flat[offset: offset + grad.numel()].view_as(grad).clone()
            offset += grad.numel()

    def gather(self, value: T) -> list[T]:
        """Every rank's `value` (picklable), in rank order; [value] on one rank. For per-step metrics."""
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered
