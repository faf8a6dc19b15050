"""The agent pool: the user's agent runs in worker processes, each episode with a wall deadline.

An episode is one call, `run(client, row)` in a worker (agent_worker.py), that ends with the agent's return or
its failure. An asyncio timeout cannot stop an agent that blocks its event loop, so the deadline is kept here:
at `timeout_s` the worker is asked to cancel the episode, and a worker that does not answer within
`cancel_grace_s` is killed with its process group. The other episodes that worker ran end as "agent_lost" (not
their fault: the caller re-runs them, replaying their calls); a worker that dies by itself ends its episodes as
"agent_crash: <how>". Time an episode spends held by a pause of the run (a weight push, a checkpoint, an
evaluation: its calls wait) does not count against its deadline (`hold` / `release`).

Elastic: a new episode goes to the least-loaded worker, and one more starts (up to max_workers) when every
worker holds EPISODES_PER_WORKER episodes (agents mostly wait on the model: one process holds many).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flashreinforce.envs.agent_worker import AgentSpec, describe_agent
from flashreinforce.lifetime import describe_exit, start_child

_STARTUP_TIMEOUT_S = 120.0
EPISODES_PER_WORKER = 8


@dataclass(frozen=True)
class AgentOutcome:
    """How an episode's agent ended: its return value, or a failure."""

    value: Any = None
    failure: str | None = None
    """agent_error: <Type: message> | agent_timeout | agent_crash: <how> | agent_lost | cancelled"""
    seconds: float = 0.0


@dataclass(eq=False)
class _Worker:
    proc: Any
    conn: Any
    episodes: dict[str, asyncio.Future] = field(default_factory=dict)


class AgentPool:
    def __init__(self, functions: AgentSpec | Mapping[str, AgentSpec], *, timeout_s: float = 600.0,
                 min_workers: int = 1, max_workers: int = 4, cancel_grace_s: float = 5.0) -> None:
        """functions: each agent task's agent, 'path/to/agent.py:run' or 'package.module:run' (or a built-in
        adapter, agent_worker.BuiltinAgent), by task name ("" in a one-task run; one agent alone is that); a row's
        task picks its agent."""
        if not 1 <= min_workers <= max_workers:
            raise ValueError(f"agent workers: need 1 <= min_workers ({min_workers}) <= max_workers ({max_workers})")
        self.functions = dict(functions) if isinstance(functions, Mapping) else {"": functions}
        self.timeout_s, self.cancel_grace_s = timeout_s, cancel_grace_s
        self.min_workers, self.max_workers = min_workers, max_workers
        self._workers: list[_Worker] = []
        self._starting = 0
        self._deadlines: dict[str, float] = {}
        self._held: set[str] = set()
        self._held_at: float | None = None
        self.counts: Counter[str] = Counter()

    async def start(self) -> None:
        """Start min_workers; an agent that cannot even be imported fails here, with its reason."""
        for _ in range(self.min_workers):
            await self._spawn()

    def stats(self) -> dict[str, float]:
        return {"workers": float(len(self._workers)), "running": float(len(self._deadlines)),
                **{k: float(v) for k, v in self.counts.items()}}

    # ---- episodes -----------------------------------------------------------------------------------------

    async def run(self, sid: str, row: dict[str, Any], base_url: str, api_key: str) -> AgentOutcome:
        """Run one episode to its end (cancelling the awaiting task cancels the episode in its worker)."""
        started = time.monotonic()
        worker = await self._pick()
        future = asyncio.get_running_loop().create_future()
        worker.episodes[sid] = future
        self._deadlines[sid] = started + self.timeout_s
        try:
            worker.conn.send(("run", sid, row, base_url, api_key, self.timeout_s))
            outcome = await self._wait(sid, worker, future)
        except asyncio.CancelledError:
            self._cancel(worker, sid)
            raise
        finally:
            self._deadlines.pop(sid, None)
            worker.episodes.pop(sid, None)
        self.counts[outcome.failure.split(":", 1)[0] if outcome.failure else "done"] += 1
        return AgentOutcome(outcome.value, outcome.failure, time.monotonic() - started)

    async def _wait(self, sid: str, worker: _Worker, future: asyncio.Future) -> AgentOutcome:
        """The episode's outcome, or agent_timeout once its deadline (moved by pauses) passes."""
        while not future.done():
            left = self._deadlines[sid] - time.monotonic()
            if sid in self._held or left > 0:
                await asyncio.wait([future], timeout=max(left, 0.05))
                continue
            self._cancel(worker, sid)
            await asyncio.wait([future], timeout=self.cancel_grace_s)
            if not future.done():  # its event loop is blocked: only killing the worker ends the episode
                self._lose(worker, f"agent_crash: killed for a blocked agent ({sid} overran)")
            return AgentOutcome(failure="agent_timeout")
        return future.result()

    def hold(self, sids: set[str]) -> None:
        """The run paused with these episodes in flight: their deadlines stop moving toward their end."""
        self._held, self._held_at = set(sids), time.monotonic()

    def release(self) -> None:
        paused, self._held_at = time.monotonic() - (self._held_at or time.monotonic()), None
        for sid in self._held & set(self._deadlines):
            self._deadlines[sid] += paused
        self._held = set()

    def _cancel(self, worker: _Worker, sid: str) -> None:
        with contextlib.suppress(OSError):
            worker.conn.send(("cancel", sid))

    # ---- workers -------------------------------------------------------------------------------------------

    async def _pick(self) -> _Worker:
        """The least-loaded worker; a new one when every worker is full and the pool may grow."""
        busy = all(len(w.episodes) >= EPISODES_PER_WORKER for w in self._workers)
        if (not self._workers or busy) and len(self._workers) + self._starting < self.max_workers:
            self._starting += 1
            try:
                return await self._spawn()
            finally:
                self._starting -= 1
        while not self._workers:  # every worker is starting (or was lost): wait for one
            await asyncio.sleep(0.05)
        return min(self._workers, key=lambda w: len(w.episodes))

    async def _spawn(self) -> _Worker:
        proc, conn = start_child("flashreinforce.envs.agent_worker", new_session=True,
                                 env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
        worker = _Worker(proc, conn)
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        loop.add_reader(conn.fileno(), self._readable, worker, ready)
        try:
            conn.send((list(sys.path), self.functions))
            await asyncio.wait_for(ready, _STARTUP_TIMEOUT_S)
            kind, reason = ready.result()
        except (asyncio.TimeoutError, OSError):
            kind, reason = "lost", f"it did not start within {_STARTUP_TIMEOUT_S:.0f} s"
        if kind != "ready":
            self._stop(worker)
            names = " ".join(f"{f'tasks.{t}.' if t else ''}{describe_agent(f)}" for t, f in self.functions.items())
            raise RuntimeError(f"{names}: the agent worker could not start: {reason}")
        self._workers.append(worker)
        self.counts["workers_started"] += 1
        return worker

    def _readable(self, worker: _Worker, ready: asyncio.Future) -> None:
        """The worker's replies: its start, then each episode's end; EOF: it died."""
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                if not ready.done():
                    ready.set_result(message)
                    continue
                future = worker.episodes.get(message[1])
                if future is not None and not future.done():
                    future.set_result(_outcome(message))
        except (EOFError, OSError):
            if not ready.done():
                ready.set_result(("lost", f"it died at start ({describe_exit(worker.proc.poll() or 0)})"))
            self._lose(worker, f"agent_crash: {describe_exit(worker.proc.wait())}")

    def _lose(self, worker: _Worker, why: str) -> None:
        """Stop a worker; its episodes end: `why` for the one it was stopped for, agent_lost for the others."""
        if worker not in self._workers and worker.conn.closed:
            return
        self._stop(worker)
        self.counts["workers_lost"] += 1
        for future in worker.episodes.values():
            if not future.done():
                future.set_result(AgentOutcome(failure="agent_lost" if "killed for" in why else why))

    def _stop(self, worker: _Worker) -> None:
        if worker in self._workers:
            self._workers.remove(worker)
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(worker.conn.fileno())
        if worker.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.proc.pid, signal.SIGKILL)  # the group: what the agent started dies too
            worker.proc.wait()
        worker.conn.close()

    async def aclose(self) -> None:
        for worker in list(self._workers):
            self._stop(worker)


def _outcome(message: tuple) -> AgentOutcome:
    kind = message[0]
    if kind == "done":
        return AgentOutcome(value=message[2])
    if kind == "error":
        return AgentOutcome(failure=f"agent_error: {message[2]}")
    return AgentOutcome(failure="cancelled")
