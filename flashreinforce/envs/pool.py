"""The environment pool: episodes' environments live in worker processes, every call has a deadline.

An asyncio or thread timeout cannot stop a CPU-bound step (verl #288), so environments run in killable
processes (envs/worker.py). Each episode is a session pinned to one worker; a call that overruns
`step_timeout_s` kills that worker's process group, ends its episode ("env_timeout") and leaves the worker's
other sessions to be rebuilt, on their next call, by replaying their recorded actions from the seeded reset
on a live worker: environments are deterministic in (prompt, seed, actions). A worker found dead by a call (killed,
out of memory, a segfault, its machine lost) is replaced the same way and the call runs once more on another
worker, by replay, so an episode outlives the loss of its worker; a call that kills its worker again (os._exit in
the step) ends its episode ("env_crash: ..."). Nothing here blocks the event loop: calls wait on the worker's
socket with add_reader.

Elastic: a new session goes to the least-loaded idle worker; when every worker is busy one more starts (up to
max_workers), and a worker with no sessions retires after idle_timeout_s (down to min_workers).

A worker is reached through a WorkerLink: a process of this machine here (ProcessWorker), a Ray actor under
backend.kind=ray (controller/ray_envs.py). Sessions, deadlines, replay and growth are the pool's, the same for both.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from flashreinforce.envs.protocol import EnvSpec, Observation, StepResult
from flashreinforce.envs.worker import EnvSpecs, as_specs
from flashreinforce.lifetime import describe_exit, start_child
from flashreinforce.types import Prompt

_STARTUP_TIMEOUT_S = 120.0  # a user environment's imports (say, textworld) can be slow


@dataclass(frozen=True)
class EnvOutcome:
    """One call's result: a value (reset observation or StepResult), or why the episode must end."""

    value: Observation | StepResult | None = None
    failure: str | None = None
    """env_timeout | env_crash: <how it died> | env_error: <Type: message>"""
    seconds: float = 0.0


class WorkerLost(Exception):
    """A worker overran a call's deadline or died (and is stopped): `failure` is how its episode ends."""

    def __init__(self, failure: str) -> None:
        super().__init__(failure)
        self.failure = failure
        """env_timeout | env_crash: <how it died>"""


class WorkerLink(Protocol):
    """One worker serving envs/worker.py's protocol. Answers are (kind, value) tuples; a call that overruns
    `timeout` or finds the worker dead stops it and raises WorkerLost."""

    async def start(self, specs: EnvSpecs, timeout: float) -> tuple[str, Any]: ...

    async def call(self, message: tuple, timeout: float) -> tuple[str, Any]: ...

    def send(self, message: tuple) -> None:
        """A message without an answer ("close")."""

    def stop(self) -> None:
        """Kill the worker (idempotent): a step that never returns ends with it."""


class ProcessWorker:
    """An environment worker process of this machine (envs/worker.py), in a process group of its own."""

    def __init__(self) -> None:
        # One thread per math library, its own process group (killed as one).
        self.proc, self.conn = start_child("flashreinforce.envs.worker", new_session=True,
                                           env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                                                "OPENBLAS_NUM_THREADS": "1"})

    async def start(self, specs: EnvSpecs, timeout: float) -> tuple[str, Any]:
        return await self.call((list(sys.path), specs), timeout)

    async def call(self, message: tuple, timeout: float) -> tuple[str, Any]:
        # Waits on the socket with add_reader: nothing blocks the event loop.
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = self.conn.fileno()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            self.conn.send(message)
            await asyncio.wait_for(readable, timeout)
            return self.conn.recv()
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            self.stop()
            raise WorkerLost("env_timeout") from None
        except (EOFError, OSError):
            self.stop()
            raise WorkerLost(f"env_crash: {describe_exit(self.proc.returncode)}") from None
        finally:
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(fd)

    def send(self, message: tuple) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(message)

    def stop(self) -> None:
        if self.proc.returncode is None:  # once: after the wait its pid (the group's id) may be another's
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group: what the environment started dies too
            self.proc.wait()
        self.conn.close()


@dataclass(eq=False)
class _Worker:
    link: WorkerLink
    busy: bool = False
    sessions: set[str] = field(default_factory=set)
    idle_since: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Session:
    prompt: Prompt
    seed: int
    actions: list[str]
    worker: _Worker | None = None
    """None: not open anywhere (new, restored from a checkpoint, or its worker died): the next call replays."""


class EnvPool:
    def __init__(self, spec: EnvSpec | EnvSpecs, *, step_timeout_s: float = 30.0, min_workers: int = 1,
                 max_workers: int = 4, idle_timeout_s: float = 30.0,
                 start_worker: Callable[[], WorkerLink] = ProcessWorker) -> None:
        """spec: the environment, or each task's ({task: spec}; every worker holds all of them).
        start_worker: a new worker's link (ProcessWorker: a process of this machine)."""
        if not 1 <= min_workers <= max_workers:
            raise ValueError(f"env workers: need 1 <= min_workers ({min_workers}) <= max_workers ({max_workers})")
        self.specs, self.step_timeout_s, self.start_worker = as_specs(spec), step_timeout_s, start_worker
        self.min_workers, self.max_workers, self.idle_timeout_s = min_workers, max_workers, idle_timeout_s
        self._workers: list[_Worker] = []
        self._sessions: dict[str, _Session] = {}
        self._free = asyncio.Condition()
        self._starting = 0
        """Workers starting for a call, outside the lock: they count toward max_workers."""
        self.counts: Counter[str] = Counter()
        self.busy_seconds = 0.0
        """Wall time summed over calls: the environment-busy time of the schedulers benchmark."""

    async def start(self) -> None:
        """Start min_workers; an environment that cannot even be built fails here, with its reason."""
        for _ in range(self.min_workers):
            await self._spawn()

    # ---- episodes ---------------------------------------------------------------------------------------

    async def reset(self, sid: str, prompt: Prompt, seed: int) -> EnvOutcome:
        self._sessions[sid] = _Session(prompt, seed, [])
        return await self._call(sid, None)

    def attach(self, sid: str, prompt: Prompt, seed: int, actions: tuple[str, ...]) -> None:
        """An episode restored from a checkpoint: opened, by replay, at its next step."""
        self._sessions[sid] = _Session(prompt, seed, list(actions))

    def has(self, sid: str) -> bool:
        return sid in self._sessions

    async def step(self, sid: str, action: str) -> EnvOutcome:
        outcome = await self._call(sid, action)
        if outcome.failure is None and sid in self._sessions:
            self._sessions[sid].actions.append(action)
        return outcome

    def close(self, sid: str) -> None:
        session = self._sessions.pop(sid, None)
        if session is not None and session.worker is not None and session.worker in self._workers:
            session.worker.sessions.discard(sid)
            session.worker.link.send(("close", sid))

    def stats(self) -> dict[str, float]:
        return {"workers": float(len(self._workers)), "sessions": float(len(self._sessions)),
                "busy_seconds": self.busy_seconds, **{k: float(v) for k, v in self.counts.items()}}

    async def aclose(self) -> None:
        for worker in list(self._workers):
            self._stop(worker)
        self._sessions.clear()

    # ---- calls --------------------------------------------------------------------------------------------

    async def _call(self, sid: str, action: str | None) -> EnvOutcome:
        """Reset (action None) or step one session: open it by replay first wherever it is not open."""
        session = self._sessions.get(sid)
        if session is None:
            raise KeyError(f"no environment session {sid!r}: reset or attach it first")
        outcome, seconds = await self._attempt(sid, session, action)
        if outcome.failure is not None and outcome.failure.startswith("env_crash"):
            # The worker died during this call or before it (killed, out of memory, its machine lost): once more on
            # another worker, by replay. A call that kills its worker itself does so again and ends its episode.
            self.counts["crash_retries"] += 1
            outcome, more = await self._attempt(sid, session, action)
            seconds += more
        return self._finish(sid, outcome, seconds)

    async def _attempt(self, sid: str, session: _Session, action: str | None) -> tuple[EnvOutcome, float]:
        worker = await self._acquire(session)
        started = time.monotonic()
        try:
            if session.worker is None or action is None:
                replay = 1 + len(session.actions)  # the reset and every replayed step get a deadline each
                outcome = await self._exchange(worker, ("open", sid, session.prompt, session.seed,
                                                        tuple(session.actions)), self.step_timeout_s * replay)
                if outcome.failure is None:
                    session.worker = worker
                    worker.sessions.add(sid)
                    self.counts["replays"] += bool(session.actions)
                if action is None or outcome.failure is not None:
                    return outcome, time.monotonic() - started
            outcome = await self._exchange(worker, ("step", sid, action), self.step_timeout_s)
            return outcome, time.monotonic() - started
        finally:
            worker.busy, worker.idle_since = False, time.monotonic()
            async with self._free:
                self._free.notify_all()

    def _finish(self, sid: str, outcome: EnvOutcome, seconds: float) -> EnvOutcome:
        self.busy_seconds += seconds
        self.counts["calls"] += 1
        if outcome.failure is not None:
            self.counts[outcome.failure.split(":", 1)[0]] += 1
            self.close(sid)
        return EnvOutcome(outcome.value, outcome.failure, seconds)

    async def _exchange(self, worker: _Worker, message: tuple, timeout: float) -> EnvOutcome:
        try:
            kind, value = await worker.link.call(message, timeout)
        except WorkerLost as lost:
            self._lose(worker)
            return EnvOutcome(failure=lost.failure)
        except asyncio.CancelledError:
            # the worker goes on with the call, and its answer would be read as the next call's: end it (its
            # sessions replay elsewhere)
            self._lose(worker)
            raise
        return EnvOutcome(value) if kind == "ok" else EnvOutcome(failure=f"env_error: {value}")

    async def _acquire(self, session: _Session) -> _Worker:
        """The session's own worker when it is open there, else the least-loaded idle one (starting one more
        when all are busy and the pool may grow); waits for it to be free."""
        async with self._free:
            while True:
                self._retire_idle()
                worker = session.worker if session.worker in self._workers else None
                if worker is None:
                    session.worker = None
                    idle = [w for w in self._workers if not w.busy]
                    if not idle and len(self._workers) + self._starting < self.max_workers:
                        self._starting += 1  # counted now, so that concurrent calls never pass max_workers
                        break
                    worker = min(idle, key=lambda w: len(w.sessions)) if idle else None
                if worker is not None and not worker.busy:
                    worker.busy = True
                    return worker
                await self._free.wait()
        # Started outside the lock: a start takes seconds (a user environment's imports), and calls to the other
        # workers, and the release of one that just answered, must not wait for it.
        try:
            return await self._spawn(busy=True)  # busy from the first moment: it is this session's
        finally:
            self._starting -= 1
            async with self._free:  # a failed start leaves room for another
                self._free.notify_all()

    # ---- workers ------------------------------------------------------------------------------------------

    async def _spawn(self, busy: bool = False) -> _Worker:
        worker = _Worker(self.start_worker(), busy=busy)
        try:
            kind, reason = await worker.link.start(self.specs, _STARTUP_TIMEOUT_S)
        except WorkerLost as lost:
            kind, reason = "lost", f"{lost.failure} during its start (allowed {_STARTUP_TIMEOUT_S:.0f} s)"
        except BaseException:
            worker.link.stop()
            raise
        if kind != "ready":
            worker.link.stop()
            kinds = " ".join(f"{f'tasks.{t}.' if t else ''}env.kind={spec.kind!r}" for t, spec in self.specs.items())
            raise RuntimeError(f"{kinds}: the environment worker could not start: {reason}")
        self._workers.append(worker)
        self.counts["workers_started"] += 1
        return worker

    def _retire_idle(self) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if (len(self._workers) > self.min_workers and not worker.busy and not worker.sessions
                    and now - worker.idle_since > self.idle_timeout_s):
                self._stop(worker)

    def _lose(self, worker: _Worker) -> None:
        """Kill a worker that overran or died; its other sessions replay elsewhere at their next call."""
        self._stop(worker)
        self.counts["workers_lost"] += 1
        for sid in worker.sessions:
            if sid in self._sessions:
                self._sessions[sid].worker = None

    def _stop(self, worker: _Worker) -> None:
        if worker in self._workers:
            self._workers.remove(worker)
        worker.link.stop()
