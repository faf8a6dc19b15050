"""The environment pool: episodes' environments live in worker processes, every call has a deadline.

An asyncio or thread timeout cannot stop a CPU-bound step (verl #288), so environments run in killable
processes (envs/worker.py). Each episode is a session pinned to one worker; a call that overruns
`step_timeout_s` kills that worker's process group, ends its episode ("env_timeout") and leaves the worker's
other sessions to be rebuilt, on their next call, by replaying their recorded actions from the seeded reset
on a live worker: environments are deterministic in (prompt, seed, actions). A worker that dies (a segfault,
os._exit) ends the episode whose call it was running ("env_crash: ...") the same way. Nothing here blocks
the event loop: calls wait on the worker's socket with add_reader.

Elastic: a new session goes to the least-loaded idle worker; when every worker is busy one more starts (up to
max_workers), and a worker with no sessions retires after idle_timeout_s (down to min_workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from flashreinforce.envs.protocol import EnvSpec, Observation, StepResult
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


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen
    conn: Connection
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
    def __init__(self, spec: EnvSpec, *, step_timeout_s: float = 30.0, min_workers: int = 1, max_workers: int = 4,
                 idle_timeout_s: float = 30.0) -> None:
        if not 1 <= min_workers <= max_workers:
            raise ValueError(f"env workers: need 1 <= min_workers ({min_workers}) <= max_workers ({max_workers})")
        self.spec, self.step_timeout_s = spec, step_timeout_s
        self.min_workers, self.max_workers, self.idle_timeout_s = min_workers, max_workers, idle_timeout_s
        self._workers: list[_Worker] = []
        self._sessions: dict[str, _Session] = {}
        self._free = asyncio.Condition()
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
            with contextlib.suppress(OSError):
                session.worker.conn.send(("close", sid))

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
                    return self._finish(sid, outcome, started)
            outcome = await self._exchange(worker, ("step", sid, action), self.step_timeout_s)
            return self._finish(sid, outcome, started)
        finally:
            worker.busy, worker.idle_since = False, time.monotonic()
            async with self._free:
                self._free.notify_all()

    def _finish(self, sid: str, outcome: EnvOutcome, started: float) -> EnvOutcome:
        seconds = time.monotonic() - started
        self.busy_seconds += seconds
        self.counts["calls"] += 1
        if outcome.failure is not None:
            self.counts[outcome.failure.split(":", 1)[0]] += 1
            self.close(sid)
        return EnvOutcome(outcome.value, outcome.failure, seconds)

    async def _exchange(self, worker: _Worker, message: tuple, timeout: float) -> EnvOutcome:
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = worker.conn.fileno()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            worker.conn.send(message)
            await asyncio.wait_for(readable, timeout)
            kind, value = worker.conn.recv()
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            self._lose(worker)
            return EnvOutcome(failure="env_timeout")
        except (EOFError, OSError):
            self._lose(worker)
            return EnvOutcome(failure=f"env_crash: {describe_exit(worker.proc.returncode)}")
        except asyncio.CancelledError:
            # the worker goes on with the call, and its answer would be read as the next call's: end it (its
            # sessions replay elsewhere)
            self._lose(worker)
            raise
        finally:
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(fd)
        return EnvOutcome(value) if kind in ("ok", "ready") else EnvOutcome(failure=f"env_error: {value}")

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
                    if not idle and len(self._workers) < self.max_workers:
                        idle = [await self._spawn()]
                    worker = min(idle, key=lambda w: len(w.sessions)) if idle else None
                if worker is not None and not worker.busy:
                    worker.busy = True
                    return worker
                await self._free.wait()

    # ---- workers ------------------------------------------------------------------------------------------

    async def _spawn(self) -> _Worker:
        proc, conn = start_child("flashreinforce.envs.worker", new_session=True,
                                 env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
        worker = _Worker(proc, conn)
        outcome = await self._exchange(worker, (list(sys.path), self.spec), _STARTUP_TIMEOUT_S)
        if outcome.failure is not None:
            self._stop(worker)
            reason = outcome.failure.removeprefix("env_error: ")
            raise RuntimeError(f"env.kind={self.spec.kind!r}: the environment worker could not start: {reason}")
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
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait()
        worker.conn.close()
