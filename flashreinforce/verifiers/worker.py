"""One verifier worker process: `python -m flashreinforce.verifiers.worker <fd> <pool pid>`, started by pool.py.

A fresh interpreter, not a fork or a multiprocessing child: those would inherit or re-import the
trainer's main module (torch, its thread pools, its memory), and this process imports only the reward
functions it runs. Protocol over the socket `fd` (pickled messages):
  pool -> worker: (sys_path, reward_refs, memory_limit_mb) once, then (ref, rows) per batch, rows a list of
                  (call_id, completion, ground_truth, prompt): one row, or up to the ref's batch size for a
                  batchable function (registry.py). The pool stops a worker with SIGKILL.
  worker -> pool: ("ready", {ref: batch_size}) or ("load_error", message) once, then ("done", [(call_id,
                  Verdict), ...]) per batch, in the rows' order, or ("crash", message) just before exiting on a
                  fatal error.
An exception from a reward function is a Verdict (for every row of its batch); what leaves the interpreter in
doubt (MemoryError, SystemExit) ends the process, and a segfault or os._exit ends it anyway: the pool replaces it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import NoReturn

from flashreinforce.lifetime import describe_error, die_with_parent
from flashreinforce.types import Prompt, Verdict
from flashreinforce.verifiers.registry import score_rows
from flashreinforce.verifiers.rewards import RewardFn, batch_size_of, load_reward_fn, to_verdict


def main(fd: int, pool_pid: int) -> None:
    die_with_parent(pool_pid)
    conn = Connection(fd)
    sys_path, refs, memory_limit_mb = conn.recv()
    sys.path[:] = sys_path  # so "package.module:fn" resolves as in the trainer
    if memory_limit_mb is not None:
        import resource

        limit = memory_limit_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    fns: dict[str, RewardFn] = {}
    batch_sizes: dict[str, int] = {}
    for ref in refs:
        try:
            fns[ref] = load_reward_fn(ref)
            batch_sizes[ref] = batch_size_of(fns[ref])  # a bad batch_size is a load error, not a per-call one
        except ValueError as e:
            conn.send(("load_error", str(e)))
            return
    _one_torch_thread()
    conn.send(("ready", batch_sizes))
    while True:
        try:
            ref, rows = conn.recv()
        except EOFError:  # the pool is gone
            return
        start = time.perf_counter()
        verdicts = _score(conn, fns[ref], rows)
        share = (time.perf_counter() - start) / len(rows)  # each row's part of the batch's time
        conn.send(("done", [(row[0], dataclasses.replace(v, seconds=share)) for row, v in zip(rows, verdicts)]))


def _score(conn: Connection, fn: RewardFn, rows: list[tuple[int, str, str, Prompt]]) -> list[Verdict]:
    """One Verdict per row: through score_batch when fn has one, else one call per row (the pool sends such a
    function one row at a time). An exception is an error Verdict for every row of the batch."""
    _, completions, ground_truths, prompts = (list(column) for column in zip(*rows))
    try:
        return [to_verdict(value) for value in score_rows(fn, completions, ground_truths, prompts)]
    except MemoryError as e:
        _crash(conn, e)
    except Exception as e:  # noqa: BLE001 - the user's function failed: an error verdict, the pool goes on
        return [Verdict(reward=0.0, passed=False, reason=f"error: {describe_error(e)}")] * len(rows)
    except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt: the function asked to stop the process
        _crash(conn, e)


def _crash(conn: Connection, error: BaseException) -> NoReturn:
    try:
        conn.send(("crash", describe_error(error)))
    finally:
        os._exit(70)  # skip atexit and finalizers: the interpreter's state is in doubt


def _one_torch_thread() -> None:
    # OMP_NUM_THREADS=1 (set by the pool) covers torch imported later; this covers a reward module that already did.
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
