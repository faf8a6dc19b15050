"""Asyncio front of the Engine: one awaitable per request, decoded by a background thread.

Threading model:
- The driver thread owns the Engine: only it calls Engine methods, so the Engine needs no locks.
  Other threads may read `stats` and `version` (immutable snapshots / plain ints).
- Coroutines post commands (submit, abort, pause, resume, load_weights) to a thread-safe queue. The
  driver runs them between decoding steps, so none lands mid-step, and answers through asyncio
  futures resolved with `loop.call_soon_threadsafe` (its only contact with the event loop).
- The driver blocks on the queue when there is nothing to decode or while paused. One small lock
  makes "closed" and the final draining of the queue atomic, so no command is left unanswered.
torch kernels release the GIL, so a trainer in the main thread overlaps with decoding.

Pause -> load_weights -> resume is invisible to a coroutine awaiting `generate()`: its future stays
pending while the request is paused and resolves once, with the finished generation (tokens sampled
after the resume carry the new version).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from flashreinforce.rollout.engine import Engine, EngineStats
from flashreinforce.types import Generation, SamplingParams

_Reply = tuple[asyncio.AbstractEventLoop, asyncio.Future]
_LATER = object()  # a command's answer that the driver sends later (generate: when the request ends)


def _settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    """Runs on the event loop: a future cancelled by its awaiter is left alone."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _reply(reply: _Reply, value: Any = None, error: BaseException | None = None) -> None:
    loop, future = reply
    if not loop.is_closed():
        loop.call_soon_threadsafe(_settle, future, value, error)


class AsyncEngine:
    """Drives an Engine from a daemon thread; call `close()` when done."""

    def __init__(self, engine: Engine):
        self.engine = engine  # driven by the driver thread only; read `stats` / `version` instead
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # makes "closed" and the final drain of the queue atomic
        self._closed = False
        self._failure: Exception | None = None
        self._submits: list[tuple] = []
        """Submits of the current event-loop turn, posted to the driver as one command (see submit())."""
        # Driver-thread state: the awaiting future of every request not yet returned, and the
        # partials held by pause() until resume() or abort().
        self._waiters: dict[str, _Reply] = {}
        self._paused: dict[str, Generation] = {}
        self._is_paused = False
        self._thread = threading.Thread(target=self._drive, name="flashreinforce-engine", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> EngineStats:
        """The latest counters (an immutable record, safe to read from any thread)."""
        return self.engine.stats

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, *, prefix: Generation | None = None
    ) -> Generation:
        """Resolves when the request finishes, or with its partial if it is aborted.

        Invalid input raises ValueError here. Cancelling the awaiting task aborts the request.
        """
        return await self.submit(request_id, prompt_ids, params, prefix=prefix)

    def submit(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, *, prefix: Generation | None = None
    ) -> asyncio.Future:
        """Like generate(), but the request is queued before this returns: a pause() or abort() called
        afterwards is guaranteed to see it. Returns the future of its Generation (call from the event loop)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        future.add_done_callback(lambda f: self._on_generate_done(request_id, f))
        # The requests submitted in one event-loop turn (an evaluation's k samples of every prompt) reach the
        # engine together, before its next step, as they do when the event loop steps it: which requests
        # decode together, and so the low bits of their log-probs, do not depend on thread timing.
        with self._lock:
            self._check_open()
            self._submits.append((request_id, tuple(prompt_ids), params, prefix, (loop, future)))
            if len(self._submits) == 1:
                loop.call_soon(self._flush_submits)
        return future

    async def abort(self, request_ids: Sequence[str]) -> list[Generation]:
        """Abort running, waiting or paused requests; their generate() calls resolve with the partials."""
        return await self._call(self._abort, list(request_ids))

    async def pause(self) -> list[Generation]:
        """Stop decoding; every running or waiting request becomes a partial, held until resume()."""
        return await self._call(self._pause)

    async def resume(self, partials: Sequence[Generation] | None = None) -> None:
        """Restart decoding. The paused requests given (all of them when None) continue under the
        current weights, and their original generate() calls resolve when they finish. Paused
        requests not given stay paused until a later resume() or abort()."""
        await self._call(self._resume, partials)

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Swap weights between two decoding steps (see Engine.load_weights). The driver thread copies
        the tensors before this returns: do not modify them until then."""
        await self._call(self.engine.load_weights, state_dict, version)

    def close(self) -> None:
        """Stop the driver thread; requests still pending fail with RuntimeError."""
        with self._lock:
            if not self._closed:
                self._queue_submits()  # so their callers get the closing error too
                self._commands.put(None)
        self._thread.join()

    # ----------------------------------------------------------------------------------------------
    # Caller side (event loop thread)

    def _post(self, command: Callable, args: tuple, reply: _Reply | None) -> None:
        with self._lock:
            self._check_open()
            self._queue_submits()  # submitted before this command: the driver sees them first
            self._commands.put((command, args, reply))

    def _check_open(self) -> None:
        if self._failure is not None:
            raise RuntimeError("the engine thread stopped on an error") from self._failure
        if self._closed:
            raise RuntimeError("the engine is closed")

    def _flush_submits(self) -> None:
        with self._lock:
            if not self._closed:
                self._queue_submits()

    def _queue_submits(self) -> None:
        """(under the lock) Hand this turn's submits to the driver as one command."""
        if self._submits:
            batch, self._submits = self._submits, []
            self._commands.put((self._submit_all, (batch,), None))

    async def _call(self, command: Callable, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._post(command, args, (loop, future))
        return await future

    def _on_generate_done(self, request_id: str, future: asyncio.Future) -> None:
        with self._lock:
            if future.cancelled() and not self._closed:
                self._commands.put((self._drop, ([request_id],), None))

    # ----------------------------------------------------------------------------------------------
    # Driver thread

    def _drive(self) -> None:
        error: Exception = RuntimeError("the engine was closed before this request finished")
        while self._run_commands(block=self._is_paused or not self.engine.has_work):
            if self._is_paused or not self.engine.has_work:
                continue
            try:
                finished = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - a thread edge: every awaiting caller gets the failure
                self._failure = error = exc
                break
            for generation in finished:
                reply = self._waiters.pop(generation.request_id, None)
                if reply is not None:  # None: its awaiter was cancelled (_drop), nobody takes the result
                    _reply(reply, generation)
        with self._lock:
            self._closed = True
            pending = list(self._waiters.values())
            while not self._commands.empty():
                item = self._commands.get()
                if item is not None and item[0] == self._submit_all:
                    pending += [submit[-1] for submit in item[1][0]]
                elif item is not None and item[2] is not None:
                    pending.append(item[2])
        for reply in pending:
            _reply(reply, error=error)

    def _run_commands(self, block: bool) -> bool:
        """Run every queued command, first waiting for one if `block`. False once close() was called."""
        while True:
            try:
                item = self._commands.get(block=block)
            except queue.Empty:
                return True
            if item is None:
                return False
            command, args, reply = item
            try:
                result = command(*args)
            except Exception as exc:  # noqa: BLE001 - bad input from a caller: raise it in that caller
                if reply is not None:
                    _reply(reply, error=exc)
            else:
                if reply is not None and result is not _LATER:
                    _reply(reply, result)
            block = False

    def _submit_all(self, batch: list[tuple]) -> object:
        for request_id, prompt_ids, params, prefix, reply in batch:
            try:
                self._submit(request_id, prompt_ids, params, prefix, reply)
            except Exception as exc:  # noqa: BLE001 - bad input from one caller: raise it in that caller
                _reply(reply, error=exc)
        return None

    def _submit(
        self,
        request_id: str,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        prefix: Generation | None,
        reply: _Reply,
    ) -> object:
        if request_id in self._waiters:
            raise ValueError(f"request {request_id!r} is already in flight: ids must be unique")
        self.engine.submit(request_id, prompt_ids, params, prefix=prefix)
        self._waiters[request_id] = reply
        return _LATER  # the reply is the finished generation, sent when the request ends

    def _abort(self, request_ids: list[str]) -> list[Generation]:
        aborted = {g.request_id: g for g in self.engine.abort(request_ids)}
        aborted.update((i, self._paused.pop(i)) for i in request_ids if i in self._paused)
        partials = [aborted[i] for i in request_ids if i in aborted]
        for partial in partials:
            _reply(self._waiters.pop(partial.request_id), partial)
        return partials

    def _drop(self, request_ids: list[str]) -> None:
        """The awaiting task was cancelled: forget the request."""
        self.engine.abort(request_ids)
        for request_id in request_ids:
            self._paused.pop(request_id, None)
            self._waiters.pop(request_id, None)

    def _pause(self) -> list[Generation]:
        partials = self.engine.pause()
        self._paused.update((p.request_id, p) for p in partials)
        self._is_paused = True
        return partials

    def _resume(self, partials: Sequence[Generation] | None) -> None:
        chosen = list(self._paused.values()) if partials is None else list(partials)
        unknown = [p.request_id for p in chosen if p.request_id not in self._paused]
        if unknown:
            raise ValueError(
                f"resume: requests {unknown[:5]} are not paused here; start them with generate(..., prefix=partial)"
            )
        for partial in chosen:
            self.engine.submit(partial.request_id, partial.prompt_ids, partial.params, prefix=partial)
            del self._paused[partial.request_id]
        self._is_paused = False
