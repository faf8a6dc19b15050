"""New weights from trainer rank 0 to every engine in one torch.distributed broadcast (the Ray backend's
backend.weight_sync=broadcast): NCCL from GPU to GPU, gloo over TCP otherwise.

The object store (the Ray backend's other path) copies the weights to rank 0's CPU, into shared memory, and
out to each engine's device again; a broadcast sends them device to device once. The group is not the
trainer's torch.distributed group (that one holds the trainer ranks only, and a process has one default
group): it is a process group of its own over a TCPStore that rank 0 holds open, with rank 0 as rank 0 and the
engines as 1..N, built directly as `ProcessGroupGloo` / `ProcessGroupNCCL` objects beside whatever default
group the process has. A group has fixed members: when an engine is lost the driver builds a new one under a
new `generation` (a prefix in the same store, so stale keys never meet).

Every push is self-describing: a JSON header (version; each tensor's name, dtype, shape; which names are tied to
another) goes first, as bytes, then the tensors in the header's order, a tied one once, so a receiver needs
nothing but the group. JSON, not pickle: the bytes come from the network.

A failure must reach the host, where the caller can leave the group: an NCCL Work's wait() only makes the current
CUDA stream wait and returns at once, so every collective is finished by polling its completion against the
group's timeout (finish()), and the NCCL group is built with TORCH_NCCL_ASYNC_ERROR_HANDLING=2, so that PyTorch's
watchdog aborts the communicator on a timeout instead of taking the whole process (trainer rank 0) down.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal
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
    member has joined (or raises after timeout_s); then rank 0 calls send() as every other rank calls receive().
    Any call that raises leaves the group unusable: close() it (the driver builds a new generation)."""

    def __init__(self, spec: WeightGroupSpec, rank: int) -> None:
        self.spec, self.rank = spec, rank
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        address = urlparse(spec.address)
        store = dist.PrefixStore(f"weights/{spec.generation}",
                                 dist.TCPStore(address.hostname, address.port, is_master=False, timeout=timeout))
        # Every member present before any communicator is made: NCCL's (made at the first collective) would wait
        # for a missing one without a timeout.
        store.set(f"joined/{rank}", "1")
        store.wait([f"joined/{r}" for r in range(spec.world_size)], timeout)
        if spec.backend == "nccl":
            # One GPU per engine and per trainer rank (Ray sets CUDA_VISIBLE_DEVICES): the current device.
            self.device = torch.device("cuda", torch.cuda.current_device())
            self._group = nccl_group(store, rank, spec.world_size, timeout)
        else:
            self.device = torch.device("cpu")
            self._group = dist.ProcessGroupGloo(store, rank, spec.world_size, timeout)
        self._broadcast([torch.zeros(1, device=self.device)])  # every member is connected before the first push

    def send(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Rank 0: `weights` at `version` to every other member (each tensor once, on this group's device; a tied
        one once for all its names)."""
        tied = tied_names(weights)
        header = {"version": version, "tied": tied, "tensors": [[name, str(t.dtype).removeprefix("torch."),
                                                                 list(t.shape)] for name, t in weights.items()]}
        data = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        self._broadcast([torch.tensor([data.numel()], dtype=torch.int64, device=self.device)])
        self._broadcast([data.to(self.device)])
        self._broadcast(_as_bytes(tensor.detach().to(self.device).contiguous())
                        for name, tensor in weights.items() if name not in tied)

    def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        """Any other rank: (version, weights) of rank 0's next send(), on this group's device, in the sender's
        order; tied names hold one tensor, as they did there."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast([size])
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._broadcast([data])
        header = json.loads(data.cpu().numpy().tobytes())
        tied: dict[str, str] = header["tied"]
        weights = {}
        for name, dtype, shape in header["tensors"]:
            if dtype not in DTYPES:
                raise ValueError(f"the weight group's header names {name!r} as {dtype}, not a weight dtype")
            if name not in tied:
                weights[name] = torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
        if not set(tied.values()) <= weights.keys():
            raise ValueError(f"the weight group's header ties names to tensors it does not send: {tied}")
        self._broadcast(_as_bytes(tensor) for tensor in weights.values())
        return int(header["version"]), {name: weights[tied.get(name, name)] for name, _, _ in header["tensors"]}

    def close(self) -> None:
        """Leave the group. NCCL communicators are aborted (they hold GPU memory and threads, and a peer may be
        gone); a gloo group only closes its sockets as it is collected."""
        if self.spec.backend == "nccl":
            self._group.abort()
        self._group = None

    def _broadcast(self, tensors: Iterable[torch.Tensor]) -> None:
        """Collective: rank 0's `tensors` into every member's, in order, finished on the host before this returns.
        gloo runs them one at a time (a failed gloo group drains its queue, each op waiting out the timeout,
        before it can be dropped); NCCL back to back on its stream and finished once, by the last (a failure
        aborts the communicator, and every op queued on it, in close())."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        work = None
        for tensor in tensors:
            if work is not None and self.spec.backend == "gloo":
                finish(work, self.spec.timeout_s)
            work = self._group.broadcast([tensor], options)
        if work is not None:
            finish(work, self.spec.timeout_s)


def tied_names(weights: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{name: the earlier name whose tensor it is}: tied weights (input and output embeddings are one tensor under
    two names in a tied model's state dict), which a push carries once."""
    first: dict[tuple, str] = {}
    tied = {}
    for name, tensor in weights.items():
        if tensor.numel() == 0:  # empty tensors may share a null address without being one tensor
            continue
        key = (tensor.device, tensor.dtype, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
               tuple(tensor.shape), tensor.stride())
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
    return tied


def copied_once(weights: Mapping[str, torch.Tensor],
                copy: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """`copy` of every tensor of `weights`, in order, a tied one copied once and the copy kept under each of its
    names: one object, so pickling the dict (Ray's object store) carries its bytes once, and a model that loads
    it is loaded with one tensor for its tied parameters."""
    tied = tied_names(weights)
    copies = {name: copy(tensor) for name, tensor in weights.items() if name not in tied}
    return {name: copies[tied.get(name, name)] for name in weights}


def finish(work: Any, timeout_s: float, *, clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> None:
    """Block this thread until the collective `work` has completed, or raise TimeoutError after `timeout_s`; raise
    what it failed with. A gloo Work's wait() blocks until then; an NCCL Work's returns at once (it only orders the
    current CUDA stream), so completion is polled, and wait() again, once completed, raises the error it ended
    with (a timeout or a peer gone, seen by PyTorch's watchdog)."""
    deadline = clock() + timeout_s
    work.wait()
    pause = 5e-5
    while not work.is_completed():
        if clock() >= deadline:
            raise TimeoutError(f"a weight-group broadcast did not complete within {timeout_s:g} s (the group's "
                               "timeout, backend.health_timeout_s): a member is gone or stuck")
        sleep(pause)
        pause = min(2 * pause, 5e-3)
    work.wait()


_NCCL_ERRORS = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_ABORT_ONLY = "2"
"""On a collective's error or timeout, PyTorch's watchdog aborts the communicator and leaves the process alone
(its default, 3, takes the process down: an engine lost mid-push would end trainer rank 0)."""


def nccl_group(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """The weight group's ProcessGroupNCCL, built with the watchdog set to abort only (it reads the setting as it
    is built); the process's own setting is back in place after, for any other group."""
    options = dist.ProcessGroupNCCL.Options()
    # The watchdog's own deadline, past finish()'s: finish() raises first and the caller aborts the group.
    options._timeout = 2 * timeout
    with _environment(_NCCL_ERRORS, _ABORT_ONLY):
        return dist.ProcessGroupNCCL(store, rank, world_size, options)


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as flat bytes (a view): gloo has no collectives for fp8 or bool, and every
    backend has them for uint8."""
    return tensor.reshape(-1).view(torch.uint8)
