"""The local backend: engine, trainer and verifier pool in one process (the default).

Two ways to drive the engine, one interface:
- overlapped (default): the engine decodes in its own thread (rollout.AsyncEngine) while the trainer
  steps in a worker thread and verification runs in the CPU pool; torch kernels release the GIL.
- lockstep (`deterministic: true`): the event loop steps the engine itself and trains inline, so the
  order of every event, and therefore every weight, is a function of the seed alone.
The engine holds its own copy of the model; `push_weights` copies the trainer's weights into it (with LoRA the
adapter alone, after a first push that carries the base: models/adapter_push.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flashreinforce.rollout.async_engine import AsyncEngine
from flashreinforce.rollout.engine import Engine
from flashreinforce.trainer.process import TrainerProcess
from flashreinforce.trainer.trainer import Trainer
from flashreinforce.types import Generation, Prompt, SamplingParams, Trajectory, Verdict
from flashreinforce.verifiers.pool import VerifierPool


class _LockstepDriver:
    """Steps the engine from the event loop: nothing happens between awaits that the loop did not ask for."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.paused: dict[str, Generation] = {}

    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
               prefix: Generation | None) -> None:
        self.engine.submit(request_id, prompt_ids, params, prefix=prefix)

    async def finished(self) -> list[Generation]:
        while self.engine.has_work:
            done = self.engine.step()
            if done:
                return done
        raise RuntimeError("finished() called with nothing running in the engine")

    async def pause(self) -> tuple[list[Generation], list[Generation]]:
        partials = self.engine.pause()
        self.paused.update((p.request_id, p) for p in partials)
        return partials, []

    async def resume(self, partials: Sequence[Generation]) -> None:
        for partial in partials:
            self.paused.pop(partial.request_id, None)
            self.submit(partial.request_id, partial.prompt_ids, partial.params, partial)

    async def abort(self, request_ids: Sequence[str]) -> list[Generation]:
        held = {i: self.paused.pop(i) for i in request_ids if i in self.paused}
        running = {g.request_id: g for g in self.engine.abort([i for i in request_ids if i not in held])}
        return [{**held, **running}[i] for i in request_ids if i in held or i in running]

    async def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self.engine.load_weights(state_dict, version)

    def close(self) -> None:
        pass


class _ThreadedDriver:
    """Adapts the engine's per-request awaitables to the backend's "whatever finished" interface."""

    def __init__(self, engine: Engine) -> None:
        self.engine = AsyncEngine(engine)
        self.futures: dict[str, asyncio.Future] = {}
        self.paused: set[str] = set()

    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
               prefix: Generation | None) -> None:
        # Queued before this returns, so a pause right after it cannot miss the request.
        self.futures[request_id] = self.engine.submit(request_id, prompt_ids, params, prefix=prefix)

    def _take_done(self) -> list[Generation]:
        done = [rid for rid, future in self.futures.items() if future.done()]
        return [self.futures.pop(rid).result() for rid in done]

    async def finished(self) -> list[Generation]:
        # Waiting on a snapshot is cancel-safe: a cancelled wait leaves every future in place.
        await asyncio.wait(list(self.futures.values()), return_when=asyncio.FIRST_COMPLETED)
        return self._take_done()

    async def pause(self) -> tuple[list[Generation], list[Generation]]:
        partials = await self.engine.pause()
        self.paused.update(p.request_id for p in partials)
        # Keep decoding new submissions (a held-out evaluation) while the paused requests stay held.
        await self.engine.resume([])
        # Requests that finished before the pause are already resolved (the engine answers in order).
        return partials, self._take_done()

    async def resume(self, partials: Sequence[Generation]) -> None:
        held = [p for p in partials if p.request_id in self.paused]
        await self.engine.resume(held)
        self.paused.difference_update(p.request_id for p in held)
        for partial in partials:  # partials restored from a checkpoint start afresh
            if partial.request_id not in self.futures:
                self.submit(partial.request_id, partial.prompt_ids, partial.params, partial)

    async def abort(self, request_ids: Sequence[str]) -> list[Generation]:
        partials = await self.engine.abort(request_ids)
        for partial in partials:  # their futures resolved with these partials: not "finished" work
            self.paused.discard(partial.request_id)
            self.futures.pop(partial.request_id)
        return partials

    async def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        await self.engine.load_weights(state_dict, version)

    def close(self) -> None:
        for future in self.futures.values():
            future.cancel()
        self.engine.close()


class LocalBackend:
    """Backend (controller/backend.py) over an in-process engine, trainer and verifier pool.

    Without a trainer it only generates and scores (evaluation of a checkpoint).
    """

    def __init__(
        self,
        engine: Engine,
        trainer: Trainer | TrainerProcess | None,
        pool: VerifierPool,
        tokenizer: Any,
        *,
        overlap: bool,
    ) -> None:
        self.trainer = trainer
        self.pool = pool
        self.tokenizer = tokenizer
        self.overlap = overlap
        self.max_batch_size = engine.max_batch_size
        self._engine = engine
        self.driver = _ThreadedDriver(engine) if overlap else _LockstepDriver(engine)
        self._in_flight: set[str] = set()
        self._base_pushed = False
        """The engine got a push with the base (a LoRA trainer's later pushes carry the adapter alone)."""

    @property
    def free_slots(self) -> int:
        return max(0, self.max_batch_size - len(self._in_flight))

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
               prefix: Generation | None = None) -> None:
        self.driver.submit(request_id, prompt_ids, params, prefix)
        self._in_flight.add(request_id)

    async def finished(self) -> list[Generation]:
        done = await self.driver.finished()
        self._in_flight.difference_update(g.request_id for g in done)
        return done

    async def score(self, items: Sequence[tuple[str, Prompt]]) -> list[Verdict]:
        if not items:
            return []
        completions, prompts = zip(*items)
        return await self.pool.score_many(completions, prompts)

    async def train(self, batch: Sequence[Trajectory]) -> dict[str, float]:
        assert self.trainer is not None, "this backend was built for generation only"
        if not self.overlap:
            return self.trainer.step(batch)
        with self.pool.yield_cpus():
            return await asyncio.to_thread(self.trainer.step, batch)

    async def pause(self) -> tuple[list[Generation], list[Generation]]:
        partials, finished = await self.driver.pause()
        self._in_flight.difference_update(g.request_id for g in (*partials, *finished))
        return partials, finished

    async def push_weights(self) -> int:
        assert self.trainer is not None, "this backend was built for generation only"
        await self.driver.load_weights(self.trainer.push_state(base=not self._base_pushed), self.trainer.version)
        self._base_pushed = True
        return self.trainer.version

    async def resume(self, partials: Sequence[Generation]) -> None:
        await self.driver.resume(partials)
        self._in_flight.update(p.request_id for p in partials)

    async def abort(self, request_ids: Sequence[str]) -> list[Generation]:
        partials = await self.driver.abort(request_ids)
        self._in_flight.difference_update(request_ids)
        return partials

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)

    def save_model(self, directory: Path) -> None:
        self.trainer.save_model(directory)
        self.tokenizer.save_pretrained(directory)

    def stats(self) -> dict[str, float]:
        engine = self._engine.stats
        metrics = {
            "engine/sampled_tokens": float(engine.sampled_tokens),
            "engine/slot_utilization": engine.slot_utilization,
            "engine/step_seconds": engine.step_seconds,
            "engine/version": float(self._engine.version),
        }
        probe = getattr(self._engine, "last_probe", None)  # the last push's check, where the engine has one
        if probe is not None:
            metrics["engine/probe_error"] = probe.error
        metrics.update({f"verifier/{k}": float(v) for k, v in self.pool.stats().items()})
        return metrics

    async def close(self) -> None:
        self.driver.close()
