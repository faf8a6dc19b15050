"""One verifier worker process: `python -m flashreinforce.verifiers.worker <fd> <pool pid>`, started by pool.py.

A fresh interpreter, not a fork or a multiprocessing child: those would inherit or re-import the
trainer's main module (torch, its thread pools, its memory), and this process imports only the reward
functions it runs. Protocol over the socket `fd` (pickled messages):
  pool -> worker: (sys_path, reward_refs, memory_limit_mb) once, then (call_id, ref, completion,
                  ground_truth, prompt) per call. The pool stops a worker with SIGKILL.
  worker -> pool: ("ready",) or ("load_error", message) once, then ("done", call_id, Verdict) per
                  call, or ("crash", call_id, message) just before exiting on a fatal error.
An exception from a reward function is a Verdict; what leaves the interpreter in doubt (MemoryError,
SystemExit) ends the process, and a segfault or os._exit ends it anyway: the pool replaces it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from multiprocessing.connection import Connection

from flashreinforce.lifetime import describe_error, die_with_parent
from flashreinforce.types import Verdict
from flashreinforce.verifiers.rewards import RewardFn, load_reward_fn, to_verdict


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
    for ref in refs:
        try:
            fns[ref] = load_reward_fn(ref)
        except ValueError as e:
            conn.send(("load_error", str(e)))
            return
    _one_torch_thread()
    conn.send(("ready",))
    while True:
        try:
            call_id, ref, completion, ground_truth, prompt = conn.recv()
        except EOFError:  # the pool is gone
            return
        start = time.perf_counter()
        try:
            verdict = to_verdict(fns[ref](completion, ground_truth, prompt))
        except MemoryError as e:
            _crash(conn, call_id, e)
        except Exception as e:
            verdict = Verdict(reward=0.0, passed=False, reason=f"error: {describe_error(e)}")
        except BaseException as e:  # SystemExit, KeyboardInterrupt: the function asked to stop the process
            _crash(conn, call_id, e)
        conn.send(("done", call_id, dataclasses.replace(verdict, seconds=time.perf_counter() - start)))


def _crash(conn: Connection, call_id: int, error: BaseException) -> None:
    try:
        conn.send(("crash", call_id, describe_error(error)))
    finally:
        os._exit(70)  # skip atexit and finalizers: the interpreter's state is in doubt


def _one_torch_thread() -> None:
    # OMP_NUM_THREADS=1 (set by the pool) covers torch imported later; this covers a reward module that already did.
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
