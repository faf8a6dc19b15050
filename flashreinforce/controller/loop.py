"""The RL loop, written once against the Backend protocol.

    admit work the scheduler allows -> engine generates -> verifier scores -> scheduler collects
    -> when the scheduler hands over a batch: one optimizer step (overlapping further generation)
    -> push the new weights between two decoding steps (in-flight requests go on), cancel over-stale
       work -> repeat
    At a checkpoint or evaluation step (every step with in_flight_updates=False), the engine is paused
    around the push and the paused requests resume under the new weights, re-reading their prefixes.

The loop owns the map of in-flight requests (request id -> RolloutTask) and nothing else: policy lives in
the scheduler, numerics in the trainer, generation in the engine. With `overlap=False` every stage runs in
turn (lockstep), which makes a run bitwise reproducible across kill and resume.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from flashreinforce.buffer import RolloutTask, Scheduler
from flashreinforce.controller.backend import Backend
from flashreinforce.controller.episodes import EpisodeBackend
from flashreinforce.envs.hints import HintedPrompts
from flashreinforce.envs.single_turn import TextEpisodes, to_trajectory
from flashreinforce.types import Generation, RolloutKey, SamplingParams, Trajectory


@dataclass(frozen=True)
class LoopSettings:
    total_steps: int
    sampling: SamplingParams
    """Base sampling parameters; each request gets its own seed derived from `seed` and its key."""
    seed: int
    checkpoint_every: int
    eval_every: int
    overlap: bool
    """Train while the engine keeps generating (default); False runs every stage in turn."""
    in_flight_updates: bool = False
    """Push weights without pausing: running requests keep their KV cache and continue (see
    RolloutConfig.in_flight_updates). False pauses and re-reads every prefix at each push."""
    task_sampling: Mapping[str, SamplingParams] = field(default_factory=dict)
    """A mixture's sampling parameters per task (its budget and truncation); `sampling` for a task not named."""


def request_seed(seed: int, key: RolloutKey) -> int:
    """A stable per-request seed: the same rollout samples the same tokens in any batch and after resume."""
    digest = hashlib.blake2b(f"{seed}/{key.prompt_id}/{key.sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def request_id(key: RolloutKey) -> str:
    return f"{key.prompt_id}#{key.sample}"


StepHook = Callable[[int, dict[str, float], Sequence[Trajectory]], None]
"""Called after each optimizer step with (new version, metrics, the trained batch)."""
CheckpointHook = Callable[[int, dict[str, Any]], None]
"""Called with (version, loop state) when a checkpoint is due; the state holds scheduler and in-flight work."""
EvalHook = Callable[[int], Awaitable[dict[str, float]]]
"""Runs a held-out evaluation at a version while the engine is paused; returns metrics."""


class RLLoop:
    def __init__(
        self,
        backend: Backend,
        scheduler: Scheduler,
        episodes: TextEpisodes,
        settings: LoopSettings,
        *,
        on_step: StepHook,
        on_checkpoint: CheckpointHook,
        evaluate: EvalHook | None = None,
        hints: HintedPrompts | None = None,
        version: int = 0,
    ) -> None:
        # Every rollout is an episode; a bare Backend runs single-turn ones (the one-turn case, same path).
        self.backend = backend if isinstance(backend, EpisodeBackend) else EpisodeBackend(backend, episodes)
        self.scheduler = scheduler
        self.episodes = episodes
        self.settings = settings
        self.on_step = on_step
        self.on_checkpoint = on_checkpoint
        self.evaluate = evaluate
        self.hints = hints
        self.version = version
        self.inflight: dict[str, RolloutTask] = {}
        self._start_step_clock()

    def _start_step_clock(self) -> None:
        """A step's time split and throughput count from here: now, the engine's counters, no verdict waits yet."""
        self._step_started = time.perf_counter()
        engine = self.backend.stats()
        self._tokens_at_step_start = engine.get("engine/sampled_tokens", 0.0)
        self._engine_seconds_at_step_start = engine.get("engine/step_seconds", 0.0)
        self._verify_seconds = 0.0  # waiting for verdicts since the last push

    # ---- the loop -------------------------------------------------------------------------------------

    async def run(self) -> None:
        waiting: asyncio.Task | None = None
        training: asyncio.Task | None = None
        batch: list[Trajectory] = []
        while True:
            if training is None:
                if self.version >= self.settings.total_steps:
                    break
                taken = self.scheduler.take_batch(self.version)
                if taken == []:  # urb: every group of D_t was filtered out; no step, ask again
                    continue
                if taken is not None and not self.settings.overlap:
                    await self._after_step(await self.backend.train(taken), taken)
                    continue
                if taken is not None:
                    batch = taken
                    training = asyncio.ensure_future(self.backend.train(batch))
            self._admit()
            waiters = [training] if training is not None else []
            if self.backend.in_flight:
                waiting = waiting or asyncio.ensure_future(self.backend.finished())
                waiters.append(waiting)
            if not waiters:
                raise RuntimeError(
                    f"the loop stalled at version {self.version}: nothing in flight, nothing to train; "
                    f"scheduler state {self.scheduler.stats()}"
                )
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if waiting is not None and waiting in done:
                await self._deliver(waiting.result())
                waiting = None
            if training is not None and training in done:
                metrics = training.result()
                training = None
                if waiting is not None:  # cancel-safe: a pending wait has taken nothing yet
                    waiting.cancel()
                    await asyncio.gather(waiting, return_exceptions=True)
                    waiting = None
                await self._after_step(metrics, batch)
        if waiting is not None:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        if self.backend.in_flight:  # resumed after the last step: the final checkpoint already holds them
            await self.backend.pause()

    def _admit(self) -> None:
        for task in self.scheduler.admit(self.backend.free_slots, self.version):
            rid = request_id(task.key)
            assert rid not in self.inflight, f"scheduler admitted {task.key} twice"
            self.inflight[rid] = task
            if task.partial is not None:
                self.backend.start(rid, task.prompt, task.partial.params, prefix=task.partial)
            else:
                base = self.settings.task_sampling.get(task.prompt.task, self.settings.sampling)
                params = replace(base, seed=request_seed(self.settings.seed, task.key))
                self.backend.start(rid, task.prompt, params, self._hint_ids(task))

    def _hint_ids(self, task: RolloutTask) -> list[int]:
        """AHRL: one hint per group, of the step the group started at (empty without hints)."""
        return self.hints.hint_ids(task.prompt, task.group_version) if self.hints is not None else []

    async def _deliver(self, generations: Sequence[Generation]) -> None:
        """Score ended episodes and hand the trajectories to the scheduler, in the given order."""
        if not generations:
            return
        tasks = [self.inflight.pop(g.request_id) for g in generations]
        started = time.perf_counter()
        verdicts = await self.backend.judge(generations)
        self._verify_seconds += time.perf_counter() - started
        for task, generation, verdict in zip(tasks, generations, verdicts):
            self.scheduler.on_finished(to_trajectory(task.key, task.prompt, task.group, generation, verdict,
                                                     hint_length=len(self._hint_ids(task))))

    async def _after_step(self, metrics: dict[str, float], batch: Sequence[Trajectory]) -> None:
        """Weight push: [pause] -> load -> drop over-stale work -> evaluate / checkpoint -> [resume].

        The pause (and the re-reading of every prefix it implies) is skipped when updates are in flight,
        except where it is needed: a checkpoint holds paused partials, an evaluation runs on a quiet
        engine, and april's method is to abort everything at an update.
        """
        self.version += 1
        final = self.version >= self.settings.total_steps
        checkpoint = final or bool(self.settings.checkpoint_every and self.version % self.settings.checkpoint_every == 0)
        evaluate = self.evaluate is not None and bool(self.settings.eval_every) and self.version % self.settings.eval_every == 0
        paused = (not self.settings.in_flight_updates or checkpoint or evaluate
                  or self.scheduler.abort_on_update)
        keep: list[Generation] = []
        if paused:
            partials, finished = await self.backend.pause()
            await self._deliver(finished)
        push_started = time.perf_counter()
        pushed = await self.backend.push_weights()
        push_seconds = time.perf_counter() - push_started
        assert pushed == self.version, f"engine got version {pushed}, loop is at {self.version}"
        cancel = set(self.scheduler.on_version(self.version))
        if paused:
            dropped = {
                p.request_id for p in partials
                if self.scheduler.abort_on_update or self.inflight[p.request_id].key in cancel
            }
            for partial in await self.backend.abort(sorted(dropped)):
                self.scheduler.on_aborted(self.inflight.pop(partial.request_id), partial)
            keep = [p for p in partials if p.request_id not in dropped]
        elif cancel:
            # A cancelled rollout that finished before the abort reached the engine still comes back
            # through finished(); the scheduler knows it was cancelled and discards it.
            ids = sorted(rid for rid, task in self.inflight.items() if task.key in cancel)
            for partial in await self.backend.abort(ids):
                self.scheduler.on_aborted(self.inflight.pop(partial.request_id), partial)
        now = time.perf_counter()
        metrics = {**metrics, **self.scheduler.stats(), **self.backend.stats()}
        # Rollout throughput between two weight pushes; evaluation time is kept out of it.
        tokens = metrics.get("engine/sampled_tokens", 0.0)
        metrics["time/step_seconds"] = now - self._step_started
        metrics["time/generation_seconds"] = metrics.get("engine/step_seconds", 0.0) - self._engine_seconds_at_step_start
        metrics["time/push_seconds"] = push_seconds
        metrics["time/verify_seconds"] = self._verify_seconds
        metrics["throughput/tokens_per_second"] = (tokens - self._tokens_at_step_start) / max(now - self._step_started, 1e-9)
        if evaluate:
            metrics.update(await self.evaluate(self.version))
            metrics["time/eval_seconds"] = time.perf_counter() - now
        self._start_step_clock()
        self.on_step(self.version, metrics, batch)
        if checkpoint:
            self.on_checkpoint(self.version, self.state_dict(keep))
        if paused and not final:  # at the end, unfinished rollouts stay paused: the final checkpoint holds them
            await self.backend.resume(keep)

    # ---- state ----------------------------------------------------------------------------------------

    def state_dict(self, paused: Sequence[Generation]) -> dict[str, Any]:
        """Scheduler state plus every in-flight task with its partial generation (taken while paused)."""
        by_id = {p.request_id: p for p in paused}
        assert set(by_id) == set(self.inflight), "checkpoint must be taken while every in-flight request is paused"
        return {
            "version": self.version,
            "scheduler": self.scheduler.state_dict(),
            # in pause order, which is the order the uninterrupted run resumes them in
            "inflight": [(self.inflight[p.request_id], p) for p in paused],
        }

    async def restore(self, state: dict[str, Any]) -> None:
        """Restore the scheduler and re-submit the in-flight partial rollouts exactly as they were."""
        self.version = int(state["version"])
        self.scheduler.load_state_dict(state["scheduler"])
        partials = []
        for task, partial in state["inflight"]:
            self.inflight[partial.request_id] = task
            self.backend.restore(partial.request_id, task.prompt, partial.params)
            partials.append(partial)
        await self.backend.resume(partials)
