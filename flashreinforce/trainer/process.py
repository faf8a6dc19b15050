"""The trainer in a process of its own, so the optimizer step does not share a GIL with decoding.

In one process the engine thread and the trainer thread take turns holding the GIL between their many
small kernels (a tiny model's decoding step is mostly Python). `TrainerProcess` has the methods of
`Trainer` that the backend calls, each a request to a child that builds and owns the real Trainer; it is
used when `backend.trainer_process` is set. A request costs ~3 ms on top of the step (measured: 271 vs
275 ms per step inline and in the child on the schedulers workload's batches).

The child is a fresh interpreter (`python -m flashreinforce.trainer.process <fd> <parent pid>`), as the
verifier workers are: a multiprocessing spawn would re-run the user's main script, a fork would inherit the
engine's threads. It dies with its parent (a killed run leaves no trainer computing on).
Messages are plain pickles over a socket pair, so tensors in them travel by value: the model once at the
start, optimizer state at a checkpoint.

Weights: the child's push (Trainer.push_state: the model's weights; with LoRA the adapter push, base included) is
laid out in one shared file (in /dev/shm when it has room) that both processes map: the child reports the layout
once it has built its trainer, the parent makes and maps the file. The child copies its push there after every
step (with LoRA the adapter alone: the frozen base only at the start and after a load), so between calls
`push_state()` and `weights()` hold the weights of `version` and the engine loads them from there without
pickling.

Errors: an exception in the child comes back as the same exception type with the child's traceback
attached as a note; a child that dies (out of memory, killed) makes the call raise TrainerProcessError
with its exit code.
"""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import astuple, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from flashreinforce.lifetime import die_with_parent, start_child
from flashreinforce.models.adapter_push import adapter_only, is_adapter_push, merged_state
from flashreinforce.trainer.trainer import Trainer
from flashreinforce.types import Trajectory

_ALIGN = 64  # bytes: every tensor of the shared layout starts on a cache line


class TrainerProcessError(RuntimeError):
    """The trainer process is gone or never started."""


@dataclass(frozen=True)
class _Slot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Bytes from the start of the shared file."""


def _layout(template: Mapping[str, torch.Tensor]) -> tuple[list[_Slot], int]:
    slots, offset = [], 0
    for name, tensor in template.items():
        slots.append(_Slot(name, tensor.dtype, tuple(tensor.shape), offset))
        offset += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    return slots, max(offset, _ALIGN)


def _map(path: str, slots: Sequence[_Slot], nbytes: int) -> dict[str, torch.Tensor]:
    """Tensors over the shared file: writes by one process are what the other reads."""
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    tensors = {}
    for slot in slots:
        size = slot.dtype.itemsize
        flat = torch.empty(0, dtype=slot.dtype).set_(storage, slot.offset // size, (math.prod(slot.shape),))
        tensors[slot.name] = flat.view(slot.shape)
    return tensors


def _weights_dir(nbytes: int) -> str:
    """/dev/shm when it can hold the weights (containers often cap it at 64 MB, and a mapping past a tmpfs's
    size dies with SIGBUS), else the temp directory, whose page cache both processes share just as well."""
    for directory in ("/dev/shm", tempfile.gettempdir()):
        if os.path.isdir(directory):
            stat = os.statvfs(directory)
            if stat.f_bavail * stat.f_frsize >= 2 * nbytes:
                return directory
    raise TrainerProcessError(
        f"no room for the trainer process's shared weights ({nbytes / 2**20:.0f} MB, twice that free needed) in "
        f"/dev/shm or {tempfile.gettempdir()}; free space there, point TMPDIR at a larger disk, or set "
        "backend.trainer_process=false")


def _send(conn: Connection, message: Any) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _publish(trainer: Trainer, weights: Mapping[str, torch.Tensor] | None, base: bool) -> None:
    """The trainer's push into the shared layout; `base`: with LoRA, the frozen base too (it changes only at a
    load)."""
    if weights is None and not trainer.sharded:  # nobody reads this rank's weights (a data-parallel rank but 0)
        return
    state = trainer.push_state(base)  # a sharded trainer's is a collective: every rank takes part, rank 0 gets it
    if weights is None:
        return
    with torch.no_grad():
        for name, tensor in state.items():
            weights[name].copy_(tensor)


def _error_reply(error: BaseException) -> tuple[str, BaseException, str]:
    """The exception itself when it survives pickling, else a RuntimeError with its text."""
    text = traceback.format_exc()
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any unpicklable exception is replaced by its text
        error = RuntimeError(f"{type(error).__name__}: {error}")
    return "error", error, text


def _share(conn: Connection, trainer: Trainer, publishes: bool) -> tuple[dict[str, torch.Tensor] | None, bool]:
    """The child's half of laying out the shared weights: its push's layout to the parent (the answer to "start"),
    which makes the file and sends its path ("publish"), and the push copied in. Returns the mapped weights (None
    when this rank publishes nothing) and whether the parent closed this child instead of sending a path."""
    state = trainer.push_state(True)  # a sharded trainer's is a collective: every rank takes part
    slots, nbytes = _layout(state)
    # plain tuples: this module is the child's __main__, whose classes the parent cannot unpickle
    _send(conn, ("ok", (([astuple(slot) for slot in slots], nbytes) if publishes else None, trainer.version)))
    command, path = _recv(conn)
    if command == "close" or path is None:  # the parent could not make the file, or publishes nothing
        return None, command == "close"
    weights = _map(path, slots, nbytes)
    with torch.no_grad():
        for name, tensor in state.items():
            weights[name].copy_(tensor)
    return weights, False


def _serve(conn: Connection) -> None:
    """The child: build the trainer, then answer requests until "close" or the parent goes away."""
    try:
        sys_path, threads, publishes = _recv(conn)
        sys.path[:] = sys_path  # before the next message: its factory resolves by name as in the parent
        torch.set_num_threads(threads)
        factory, args = _recv(conn)
        trainer = factory(*args)
        weights, closing = _share(conn, trainer, publishes)
    except Exception as error:  # noqa: BLE001 - reported to the parent, which raises it
        _send(conn, _error_reply(error))
        return
    _send(conn, ("ok", (None, trainer.version)))  # the answer to "publish" (or to "close")
    if closing:
        return
    handlers: dict[str, Callable[[Any], Any]] = {
        "step": trainer.step,
        "state_dict": lambda _: trainer.state_dict(),
        "load_state_dict": trainer.load_state_dict,
        "save_model": trainer.save_model,
    }
    while True:
        try:
            command, payload = _recv(conn)
        except (EOFError, OSError):  # the parent is gone
            return
        if command == "close":
            _send(conn, ("ok", (None, trainer.version)))
            return
        try:
            value = handlers[command](payload)
            if command in ("step", "load_state_dict"):
                _publish(trainer, weights, base=command == "load_state_dict")
        except Exception as error:  # noqa: BLE001 - reported to the parent, which raises it
            _send(conn, _error_reply(error))
            continue
        _send(conn, ("ok", (value, trainer.version)))


class TrainerProcess:
    """A Trainer built by `factory(*args)` in a child process; call `close()` when done.

    `factory` must be importable by name (a module-level function) and `args` picklable (the model goes by
    value). One request runs at a time; `version` is the trainer's as of the last answer. The child is
    killed when the thread that built this object exits (lifetime.die_with_parent): build it in the thread
    that runs the loop.
    """

    def __init__(self, factory: Callable[..., Trainer], args: tuple, *, publishes: bool = True, threads: int) -> None:
        """publishes False: the child publishes no weights (a data-parallel rank whose peer rank 0 does)."""
        self._lock = threading.Lock()
        self.version = 0
        self._weights: dict[str, torch.Tensor] | None = None
        path = None
        try:
            self._proc, self._conn = start_child("flashreinforce.trainer.process")
            try:
                _send(self._conn, (list(sys.path), threads, publishes))
                _send(self._conn, (factory, args))
            except OSError as error:  # it died at once
                raise self._gone("start") from error
            layout = self._receive("start")
            if layout is not None:
                slots, nbytes = [_Slot(*slot) for slot in layout[0]], layout[1]
                handle, path = tempfile.mkstemp(prefix="flashreinforce-weights-", dir=_weights_dir(nbytes))
                os.close(handle)
                self._weights = _map(path, slots, nbytes)
            self._call("publish", path)
        except BaseException:
            if hasattr(self, "_proc"):
                self.close()
            raise
        finally:
            if path is not None:
                os.unlink(path)  # both processes hold the mapping; the name is no longer needed

    def step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        return self._call("step", list(trajectories))

    def push_state(self, base: bool = True) -> dict[str, torch.Tensor]:
        """Trainer.push_state of `version` (shared memory: read it only while no step runs)."""
        weights = self._published()
        return weights if base or not is_adapter_push(weights) else adapter_only(weights)

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights of `version`, with LoRA merged here from the published push (shared memory: read them only
        while no step runs)."""
        return merged_state(self._published())

    def _published(self) -> dict[str, torch.Tensor]:
        if self._weights is None:
            raise RuntimeError("this trainer process was started with publishes=False and publishes no weights; "
                               "read them from the rank that does (rank 0 of a data-parallel group)")
        return self._weights

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._call("load_state_dict", dict(state))

    def save_model(self, directory: Path) -> None:
        self._call("save_model", Path(directory))

    def close(self) -> None:
        """Ask the child to exit; kill it if it does not within 10 s. Safe to call twice."""
        if self._proc.poll() is None:
            try:
                self._call("close")
                self._proc.wait(timeout=10)
            except (TrainerProcessError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        if hasattr(self, "_conn"):
            self._conn.close()

    def kill(self) -> None:
        """End the child at once (a data-parallel group whose peer failed: it would wait for it forever)."""
        if hasattr(self, "_proc") and self._proc.poll() is None:
            self._proc.kill()

    def _call(self, command: str, payload: Any = None) -> Any:
        with self._lock:
            if self._conn.closed:
                raise TrainerProcessError(f"the trainer process was closed; cannot run {command!r}")
            try:
                _send(self._conn, (command, payload))
            except OSError as error:
                raise self._gone(command) from error
            return self._receive(command)

    def _receive(self, command: str) -> Any:
        try:
            reply = _recv(self._conn)
        except (EOFError, OSError) as error:
            raise self._gone(command) from error
        if reply[0] == "error":
            _, error, text = reply
            error.add_note(f"raised in the trainer process during {command!r}:\n{text}")
            raise error
        value, self.version = reply[1]
        return value

    def _gone(self, command: str) -> TrainerProcessError:
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return TrainerProcessError(
            f"the trainer process exited (code {code}) before answering {command!r}; its stderr says why "
            "(a negative code is the signal that ended it: -9 is a kill, often the out-of-memory killer)"
        )


if __name__ == "__main__":
    die_with_parent(int(sys.argv[2]))
    _serve(Connection(int(sys.argv[1])))
