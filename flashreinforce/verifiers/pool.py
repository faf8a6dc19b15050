"""The elastic CPU pool that runs verifier calls in worker processes, isolated and time-bounded.

Every call ends in a Verdict: a reward function that raises gives reason "error: <Type>: <message>",
one that overruns `timeout_s` is killed ("timeout"), one whose process dies (segfault, os._exit,
MemoryError) gives "crash: ..." and its worker is replaced. User code never raises into the caller.

Elastic: between min_workers and max_workers processes. A worker is added when calls wait, no worker
is free and a CPU is idle; one idle for `idle_timeout_s` retires (down to min_workers). Inside
`with pool.yield_cpus():` (the trainer's compute) at most max(1, min_workers) workers score at once;
the other workers stay parked with their imports warm rather than being killed and restarted
every step. A batchable reward function (registry.py: score_batch, batch_size) gets up to batch_size queued
calls of its reference at once on an idle worker; each call keeps its own Future, deadline and Verdict, and a
timeout or crash of the batch answers each of its calls as it would a single one. One dispatcher thread
owns the workers; `submit` is safe from any thread, `score` from an event loop. POSIX only (process groups,
/proc/stat or the load average).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from flashreinforce.lifetime import describe_exit, start_child
from flashreinforce.types import Prompt, Verdict
from flashreinforce.verifiers.rewards import resolve_reward_ref

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11; the project supports 3.10

log = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0  # importing a user's reward module (say, one that imports torch) can be slow
_RESPAWN_BACKOFF_S = 1.0  # after a worker fails to start, so a broken environment is not a fork loop
_TICK_S = 0.05  # how often a waiting queue re-checks for idle CPUs


@dataclass(eq=False)
class _Call:
    id: int
    ref: str
    completion: str
    prompt: Prompt
    future: Future
    deadline: float = 0.0
    started: float = 0.0


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    ready: bool = False
    calls: list[_Call] = field(default_factory=list)
    """The batch it is scoring (one call for a function that is not batchable); empty when idle."""
    idle_since: float = field(default_factory=time.monotonic)


class VerifierPool:
    """Runs reward functions in worker processes: per-call timeout, crash isolation, elastic size.

    >>> with VerifierPool(["math"], timeout_s=5.0) as pool:
    ...     pool.score_sync("<think>2+3+0=5;</think>5", prompt)       # Verdict(reward=1.0, passed=True, ...)
    ...     verdict = await pool.score(completion, prompt)             # from the controller's event loop
    ...     with pool.yield_cpus():                                    # around the optimizer step
    ...         trainer.step(batch)
    """

    def __init__(
        self,
        reward_fns: Sequence[str] = ("math",),
        *,
        timeout_s: float = 5.0,
        min_workers: int = 1,
        max_workers: int = 2,
        idle_timeout_s: float = 30.0,
        memory_limit_mb: int | None = None,
        idle_cpus: Callable[[], float] | None = None,
        task_refs: Mapping[str, str] | None = None,
    ) -> None:
        """reward_fns: references (see rewards.py) loaded by every worker; a bad one is a ValueError here.
        task_refs: a mixture's verifier per task (one of reward_fns): a prompt of that task is scored with it
        unless the call names another; the first of reward_fns scores the rest.
        memory_limit_mb caps each worker's address space (a call over it crashes with MemoryError).
        idle_cpus: how many CPUs are idle now (default: measured from /proc/stat or the load average).
        """
        if not reward_fns:
            raise ValueError("VerifierPool needs at least one reward function, e.g. reward_fns=['math']")
        if timeout_s <= 0 or idle_timeout_s < 0:
            raise ValueError(f"timeout_s={timeout_s}, idle_timeout_s={idle_timeout_s}: use timeout_s > 0, "
                             "idle_timeout_s >= 0")
        if memory_limit_mb is not None and memory_limit_mb <= 0:
            raise ValueError(f"memory_limit_mb={memory_limit_mb}: use a positive number of MiB, or None for no limit")
        if not 0 <= min_workers <= max_workers or max_workers < 1:
            raise ValueError(f"min_workers={min_workers}, max_workers={max_workers}: "
                             "need 0 <= min_workers <= max_workers and max_workers >= 1")
        self._refs = {ref: resolve_reward_ref(ref) for ref in reward_fns}
        self._default_ref = reward_fns[0]
        self._task_refs = dict(task_refs or {})
        unloaded = {task: ref for task, ref in self._task_refs.items() if ref not in self._refs}
        if unloaded:
            raise ValueError(f"task_refs {unloaded} name verifiers not in reward_fns {list(reward_fns)}")
        self.timeout_s = timeout_s
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.idle_timeout_s = idle_timeout_s
        self._memory_limit_mb = memory_limit_mb
        self._idle_cpus = idle_cpus or _CpuMeter()

        self._lock = threading.Lock()  # guards the fields below that other threads touch
        self._inbox: collections.deque[_Call] = collections.deque()
        self._busy = 0
        self._closed = False
        self._counts: collections.Counter[str] = collections.Counter()
        self._gauges: dict[str, float] = {}
        self._pids: tuple[int, ...] = ()

        # Owned by the dispatcher thread only.
        self._workers: list[_Worker] = []
        self._queue: collections.deque[_Call] = collections.deque()
        self._spawn_after = 0.0
        self._call_ids = itertools.count()
        self._loaded: Future[None] = Future()  # the first worker's verdict on the reward references
        self._batch_sizes: dict[str, int] = {}  # ref -> calls sent at once, from the workers' "ready"

        self._wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        self._wake_w: int | None = wake_w  # None once closed: a stale fd number may belong to another file
        # Workers are spawned by this thread and die with it (PR_SET_PDEATHSIG follows the spawning thread),
        # which is what we want: it lives exactly as long as the pool.
        self._thread = threading.Thread(target=self._run, name="verifier-pool", daemon=True)
        self._thread.start()
        try:
            error = self._loaded.result(timeout=_STARTUP_TIMEOUT_S)
        except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            error = f"no verifier worker became ready within {_STARTUP_TIMEOUT_S:.0f} s"
        if error is not None:
            self.close()
            raise ValueError(error)

    # ---- public API (any thread) ----

    def submit(self, completion: str, prompt: Prompt, *, reward_fn: str | None = None) -> Future[Verdict]:
        """Queue one call; the Future's result is its Verdict (it never holds an exception from user code)."""
        ref = self._task_refs.get(prompt.task, self._default_ref) if reward_fn is None else reward_fn
        if ref not in self._refs:
            raise ValueError(f"reward function {ref!r} was not loaded by this pool; pass it in "
                             f"VerifierPool(reward_fns=[...]) (loaded: {list(self._refs)})")
        future: Future[Verdict] = Future()
        call = _Call(id=next(self._call_ids), ref=self._refs[ref], completion=completion, prompt=prompt,
                     future=future)
        with self._lock:
            if self._closed:
                raise RuntimeError("VerifierPool is closed")
            self._inbox.append(call)
        self._wake()
        return future

    async def score(self, completion: str, prompt: Prompt, *, reward_fn: str | None = None) -> Verdict:
        return await asyncio.wrap_future(self.submit(completion, prompt, reward_fn=reward_fn))

    async def score_many(self, completions: Sequence[str], prompts: Sequence[Prompt], *,
                         reward_fn: str | None = None) -> list[Verdict]:
        if len(completions) != len(prompts):
            raise ValueError(f"score_many got {len(completions)} completions for {len(prompts)} prompts; pair them up")
        futures = [self.submit(c, p, reward_fn=reward_fn) for c, p in zip(completions, prompts)]
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    def score_sync(self, completion: str, prompt: Prompt, *, reward_fn: str | None = None) -> Verdict:
        return self.submit(completion, prompt, reward_fn=reward_fn).result()

    @contextlib.contextmanager
    def yield_cpus(self) -> Iterator[None]:
        """While inside, at most max(1, min_workers) workers score at once: the trainer gets the other CPUs."""
        with self._lock:
            self._busy += 1
        self._wake()
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
            self._wake()

    def stats(self) -> dict[str, float]:
        """Counters since start: calls, batches (sent to a worker, one call or several), reason/<ok|wrong|
        no_answer|error|timeout|crash|...>, the calls whose Verdict carried each hacking-watch sign (exited_early,
        base_exception, not_plain, unverified_asserts), workers_started; gauges: workers (alive), running (calls
        in workers), queued, limit (workers allowed to score at once now)."""
        with self._lock:
            return {**self._counts, **self._gauges, "limit": self._allowed()}  # live: yield_cpus acts at once

    def worker_pids(self) -> tuple[int, ...]:
        with self._lock:
            return self._pids

    def close(self) -> None:
        """Stop every worker this pool started (by PID) and fail calls still waiting with RuntimeError."""
        with self._lock:
            self._closed = True
        self._wake()
        self._thread.join()
        with self._lock:
            if self._wake_w is not None:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_w = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- dispatcher thread ----

    def _run(self) -> None:
        try:
            while not self._closing():
                now = time.monotonic()
                self._expire(now)
                self._scale(now)
                self._dispatch(now)
                self._publish()
                ready = wait([self._wake_r, *(w.conn for w in self._workers)], self._sleep(now))
                for worker in [w for w in self._workers if w.conn in ready]:
                    self._receive(worker)
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
        except BaseException:  # a bug here must not leave callers waiting forever
            log.exception("verifier pool dispatcher failed; closing the pool")
            with self._lock:
                self._closed = True
        finally:
            self._shutdown()

    def _closing(self) -> bool:
        with self._lock:
            self._queue.extend(self._inbox)
            self._inbox.clear()
            return self._closed

    def _limit(self) -> int:
        with self._lock:
            return self._allowed()

    def _allowed(self) -> int:
        """Workers allowed to score at once (the caller holds the lock)."""
        return max(1, self.min_workers) if self._busy else self.max_workers

    def _expire(self, now: float) -> None:
        for worker in [w for w in self._workers if w.calls and now >= w.calls[0].deadline]:  # a batch's is shared
            calls = worker.calls
            self._stop(worker)
            for call in calls:
                self._finish(call, Verdict(reward=0.0, passed=False, reason="timeout", seconds=now - call.started))

    def _scale(self, now: float) -> None:
        limit = self._limit()
        idle = [w for w in self._workers if w.ready and not w.calls]
        # Retire the longest-idle first: down to min_workers after idle_timeout_s.
        for worker in sorted(idle, key=lambda w: w.idle_since):
            if len(self._workers) > self.min_workers and now - worker.idle_since >= self.idle_timeout_s:
                self._stop(worker)
                idle.remove(worker)
        if now < self._spawn_after or any(not w.ready for w in self._workers):
            return  # one start at a time: the next decision sees its effect
        if not self._loaded.done() or len(self._workers) < max(self.min_workers, bool(self._queue)):
            self._spawn()  # the floor; and with min_workers=0, one worker whenever calls wait
        elif self._queue and not idle and len(self._workers) < limit and self._idle_cpus() >= 1.0:
            self._spawn()

    def _dispatch(self, now: float) -> None:
        idle = [w for w in self._workers if w.ready and not w.calls]
        running = sum(bool(w.calls) for w in self._workers)
        limit = self._limit()
        while self._queue and idle and running < limit:
            calls = self._next_batch()
            if not calls:
                continue
            worker = idle.pop(0)
            rows = [(c.id, c.completion, c.prompt.ground_truth, c.prompt) for c in calls]
            try:
                worker.conn.send((calls[0].ref, rows))
            except OSError:  # the worker just died; _receive will see it, and the calls go to another
                self._queue.extendleft(reversed(calls))
                continue
            for call in calls:
                call.started, call.deadline = now, now + self.timeout_s
            worker.calls = calls
            running += 1
            self._count("batches")

    def _next_batch(self) -> list[_Call]:
        """The first queued call and, when its reference is batchable, the next queued calls of the same reference
        up to its batch size (the others keep their places); calls cancelled while they waited are dropped."""
        first = self._queue.popleft()
        if not _claim(first):
            return []
        batch, size = [first], self._batch_sizes.get(first.ref, 1)
        if size > 1:
            rest: collections.deque[_Call] = collections.deque()
            while self._queue and len(batch) < size:
                call = self._queue.popleft()
                if call.ref != first.ref:
                    rest.append(call)
                elif _claim(call):
                    batch.append(call)
            self._queue.extendleft(reversed(rest))
        return batch

    def _receive(self, worker: _Worker) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            self._on_exit(worker)
            return
        kind = message[0]
        if kind == "ready":
            worker.ready, worker.idle_since = True, time.monotonic()
            self._batch_sizes.update(message[1])
            if not self._loaded.done():
                self._loaded.set_result(None)
        elif kind == "load_error":
            if not self._loaded.done():
                self._loaded.set_result(message[1])
        elif kind == "done":
            calls, answers = worker.calls, message[1]
            assert [c.id for c in calls] == [i for i, _ in answers], f"worker answered {answers}, ran {calls}"
            worker.calls, worker.idle_since = [], time.monotonic()
            for call, (_, verdict) in zip(calls, answers):
                self._finish(call, verdict)
        elif kind == "crash":  # the worker is exiting: reap it now, before another call is sent to it
            calls, worker.calls = worker.calls, []
            self._stop(worker)
            self._count("worker_crashes")
            for call in calls:
                self._finish(call, Verdict(reward=0.0, passed=False, reason=f"crash: {message[1]}",
                                           seconds=time.monotonic() - call.started))
        else:
            raise AssertionError(f"unknown message from verifier worker {worker.proc.pid}: {message!r}")

    def _on_exit(self, worker: _Worker) -> None:
        """The worker's socket closed: it exited or was killed. Reap it and answer each call of its batch."""
        self._stop(worker)
        returncode = worker.proc.returncode
        if not worker.ready:
            self._spawn_after = time.monotonic() + _RESPAWN_BACKOFF_S
            message = f"a verifier worker exited with code {returncode} before it was ready; its stderr says why"
            if not self._loaded.done():
                self._loaded.set_result(message)
            log.warning("%s; retrying in %.0f s", message, _RESPAWN_BACKOFF_S)
            return
        self._count("worker_crashes")
        for call in worker.calls:
            self._finish(call, Verdict(reward=0.0, passed=False, reason=f"crash: {describe_exit(returncode)}",
                                       seconds=time.monotonic() - call.started))

    def _finish(self, call: _Call, verdict: Verdict) -> None:
        self._count("calls", f"reason/{verdict.reason.split(':', 1)[0]}", *verdict.signs)
        self._publish()  # so a caller woken by this result reads gauges that include it
        call.future.set_result(verdict)

    def _count(self, *keys: str) -> None:
        with self._lock:
            self._counts.update(keys)

    def _spawn(self) -> None:
        # One thread per math library, its own process group (killed as one).
        proc, conn = start_child("flashreinforce.verifiers.worker", new_session=True,
                                 env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
        with contextlib.suppress(OSError):  # it died at once: _receive sees the EOF
            conn.send((list(sys.path), sorted(set(self._refs.values())), self._memory_limit_mb))
        self._workers.append(_Worker(proc=proc, conn=conn))
        self._count("workers_started")

    def _stop(self, worker: _Worker) -> None:
        """SIGKILL the worker's process group (it and whatever its reward function started), then reap it.

        Idle or not, a worker holds nothing worth a graceful exit. Killing before reaping also means the
        group id cannot have been reused by an unrelated process.
        """
        self._workers.remove(worker)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait()
        worker.conn.close()

    def _sleep(self, now: float) -> float | None:
        wakes = [w.calls[0].deadline for w in self._workers if w.calls]
        wakes += [w.idle_since + self.idle_timeout_s for w in self._workers if w.ready and not w.calls
                  and len(self._workers) > self.min_workers]
        if self._queue and len(self._workers) < self._limit():  # waiting for an idle CPU to grow
            wakes.append(max(now + _TICK_S, self._spawn_after))
        return max(0.0, min(wakes) - now) if wakes else None

    def _publish(self) -> None:
        with self._lock:
            self._gauges = {
                "workers": len(self._workers),
                "running": sum(len(w.calls) for w in self._workers),
                "queued": len(self._queue) + len(self._inbox),
            }
            self._pids = tuple(w.proc.pid for w in self._workers)

    def _shutdown(self) -> None:
        self._closing()  # moves calls still in the inbox to the queue, to be failed below
        error = RuntimeError("VerifierPool closed before this call finished")
        for call in self._queue:
            if call.future.running() or call.future.set_running_or_notify_cancel():  # False: cancelled
                call.future.set_exception(error)
        for worker in self._workers:
            for call in worker.calls:
                call.future.set_exception(error)
        self._queue.clear()
        for worker in list(self._workers):
            self._stop(worker)
        if not self._loaded.done():
            self._loaded.set_result("the verifier pool closed while starting")
        self._publish()

    def _wake(self) -> None:
        with self._lock:
            if self._wake_w is not None:
                with contextlib.suppress(BlockingIOError):  # a full pipe wakes the dispatcher anyway
                    os.write(self._wake_w, b"x")


def _claim(call: _Call) -> bool:
    """Mark a queued call running; False when its caller cancelled it while it waited (one already running was
    requeued after a failed send)."""
    return call.future.running() or call.future.set_running_or_notify_cancel()


class _CpuMeter:
    """Idle CPUs over the interval since the previous reading (Linux /proc/stat), else from the load average."""

    _MIN_INTERVAL_S = 0.1  # jiffies are 10 ms: shorter intervals are noise

    def __init__(self) -> None:
        self._cpus = os.cpu_count() or 1
        self._last = self._read()
        self._last_time = time.monotonic()
        self._value = 0.0  # nothing measured yet: do not grow on a guess

    def __call__(self) -> float:
        if self._last is None:
            return self._cpus - os.getloadavg()[0]
        now = time.monotonic()
        if now - self._last_time >= self._MIN_INTERVAL_S:
            sample = self._read()
            assert sample is not None
            idle, total = sample[0] - self._last[0], sample[1] - self._last[1]
            self._value = self._cpus * idle / total if total > 0 else self._value
            self._last, self._last_time = sample, now
        return self._value

    @staticmethod
    def _read() -> tuple[int, int] | None:
        """(idle + iowait, total) jiffies over all CPUs, or None off Linux."""
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:9]]
        except FileNotFoundError:
            return None
        return fields[3] + fields[4], sum(fields)
