"""New weights from trainer rank 0 to every engine in one torch.distributed broadcast (the Ray backend's
backend.weight_sync=broadcast): NCCL from GPU to GPU, gloo over TCP otherwise.

The object store (the Ray backend's other path) copies the weights to rank 0's CPU, into shared memory, and
out to each engine's device again; a broadcast sends them device to device once. The group is not the
trainer's torch.distributed group (that one holds the trainer ranks only, and a process has one default
group): it is a process group of its own over a TCPStore that rank 0 holds open, with rank 0 as rank 0 and the
engines as 1..N, built directly as `ProcessGroupGloo` / `ProcessGroupNCCL` objects beside whatever default
group the process has. A group has fixed members: when an engine is lost the driver builds a new one under a
new `generation` (a prefix in the same store, so stale keys never meet).

Every push is self-describing: a JSON header (version; each tensor's name, dtype, shape) goes first, as bytes,
then the tensors in the header's order, so a receiver needs nothing but the group. JSON, not pickle: the bytes
come from the network.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlparse

import torch
import torch.distributed as dist

DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
"""The dtypes a header may name (a model's weights and buffers)."""


@dataclass(frozen=True)
class WeightGroupSpec:
    """Where one generation of the weight group meets: rank 0's store and how many members it waits for."""

    address: str
    """tcp://host:port of the TCPStore rank 0 holds open (trainer/distributed.py's launcher_store)."""
    generation: int
    world_size: int
    """Rank 0 (the sender) and one rank per engine."""
    backend: Literal["gloo", "nccl"]
    timeout_s: float
    """How long a member waits for the others: to join, and in each collective."""


class WeightGroup:
    """This process's membership of one generation of the weight group. Building it blocks until every
    member has joined (or raises after timeout_s); then rank 0 calls send() as every other rank calls receive()."""

    def __init__(self, spec: WeightGroupSpec, rank: int) -> None:
        self.spec, self.rank = spec, rank
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        address = urlparse(spec.address)
        store = dist.PrefixStore(f"weights/{spec.generation}",
                                 dist.TCPStore(address.hostname, address.port, is_master=False, timeout=timeout))
        if spec.backend == "nccl":
            # One GPU per engine and per trainer rank (Ray sets CUDA_VISIBLE_DEVICES): the current device.
            self.device = torch.device("cuda", torch.cuda.current_device())
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(store, rank, spec.world_size, options)
        else:
            self.device = torch.device("cpu")
            self._group = dist.ProcessGroupGloo(store, rank, spec.world_size, timeout)
        self._broadcast(torch.zeros(1, device=self.device))  # every member is connected before the first push

    def send(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Rank 0: `weights` at `version` to every other member (each tensor once, on this group's device)."""
        header = {"version": version,
                  "tensors": [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in weights.items()]}
        data = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        self._broadcast(torch.tensor([data.numel()], dtype=torch.int64, device=self.device))
        self._broadcast(data.to(self.device))
        for tensor in weights.values():
            self._broadcast(_as_bytes(tensor.detach().to(self.device).contiguous()))

    def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        """Any other rank: (version, weights) of rank 0's next send(), on this group's device."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(size)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(data)
        header = json.loads(data.cpu().numpy().tobytes())
        weights = {}
        for name, dtype, shape in header["tensors"]:
            if dtype not in DTYPES:
                raise ValueError(f"the weight group's header names {name!r} as {dtype}, not a weight dtype")
            weights[name] = torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
            self._broadcast(_as_bytes(weights[name]))
        return int(header["version"]), weights

    def close(self) -> None:
        """Leave the group. NCCL communicators are aborted (they hold GPU memory and threads, and a peer may be
        gone); a gloo group only closes its sockets as it is collected."""
        if self.spec.backend == "nccl":
            self._group.abort()
        self._group = None

    def _broadcast(self, tensor: torch.Tensor) -> None:
        """Collective: rank 0's `tensor` into every member's."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._group.broadcast([tensor], options).wait()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as flat bytes (a view): gloo has no collectives for fp8 or bool, and every
    backend has them for uint8."""
    return tensor.reshape(-1).view(torch.uint8)
