"""The Ray backend's actors: a rollout engine, a trainer rank and a verifier pool, each a process of its own.

Plain classes that controller/ray_backend.py turns into actors (`ray.remote(cls).options(...)`). Each builds its
part in its constructor, from a factory the run layer hands in (the controller never imports run/): Ray restarts
a dead actor by running only its constructor again, so everything an actor holds must come from there. They
know nothing of the loop, the scheduler or each other; the driver keeps the books (what each engine owns,
which weights are current) and these only answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from flashreinforce.types import Generation, Prompt, SamplingParams, Trajectory, Verdict


@dataclass(frozen=True)
class Submission:
    """One request as the driver sent it: what a live engine gets again if this one is lost."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    prefix: Generation | None


@dataclass(frozen=True)
class EngineReport:
    """An engine actor's answer to a poll: what finished since the last answer, and its counters."""

    generations: list[Generation]
    stats: Any
    """rollout.engine.EngineStats of this incarnation (a restart starts them from zero)."""
    version: int


class EngineActor:
    """An Engine (`factory(config, policy, shape)`) decoding in a background thread (rollout.AsyncEngine).

    An async actor: its methods run on one event loop, the engine's steps in the AsyncEngine's thread, so a
    poll is answered between two decoding steps. Requests that end are kept until a poll takes them.
    """

    def __init__(self, threads: int, factory: Callable[..., Any], config: Any, policy: Any, shape: Any) -> None:
        # torch only in the actors that compute: a verifier actor's process stays light.
        import torch

        from flashreinforce.rollout.async_engine import AsyncEngine

        torch.set_num_threads(threads)
        self.engine = AsyncEngine(factory(config, policy, shape))
        self.futures: dict[str, asyncio.Future] = {}
        self.done: list[Generation] = []
        self.failure: BaseException | None = None
        self.wake = asyncio.Event()
        self.weight_group: Any = None
        """rollout.weight_broadcast.WeightGroup of backend.weight_sync=broadcast, once the driver built one."""

    async def submit(self, requests: Sequence[Submission]) -> None:
        """Queue the requests (all before the engine's next step: AsyncEngine batches one event-loop turn)."""
        for request in requests:
            future = self.engine.submit(request.request_id, request.prompt_ids, request.params, prefix=request.prefix)
            self.futures[request.request_id] = future
            future.add_done_callback(functools.partial(self._on_done, request.request_id))

    def _on_done(self, request_id: str, future: asyncio.Future) -> None:
        if self.futures.get(request_id) is future:
            del self.futures[request_id]
        if future.cancelled():
            return
        if future.exception() is not None:  # bad input or a failed engine: the next poll raises it
            self.failure = self.failure or future.exception()
        elif future.result().finish_reason != "abort":  # aborted and paused ones go back as partials instead
            self.done.append(future.result())
        self.wake.set()

    async def in_flight(self) -> int:
        """How many requests this engine holds now (submitted, not yet finished, aborted or paused)."""
        return len(self.futures)

    async def finished(self, wait_s: float) -> EngineReport:
        """What finished since the last poll; waits up to `wait_s` for something to finish (a long poll)."""
        if not self.done and self.failure is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), wait_s)
        self.wake.clear()
        if self.failure is not None:
            raise self.failure
        return self._report()

    async def pause(self) -> tuple[list[Generation], EngineReport]:
        """Stop every request in flight: (their partials, a report of those that finished before). The engine
        keeps no paused state: the driver resumes a partial by submitting it again as a prefix, here or on
        another engine, which is what resuming is on one engine too."""
        partials = await self.engine.abort(list(self.futures))
        # Requests that finished before the abort reached the engine thread were answered before it (the
        # thread answers in order), so their callbacks ran and `done` holds them.
        self.wake.set()  # a poll waiting now returns at once
        return partials, self._report()

    async def abort(self, request_ids: Sequence[str]) -> list[Generation]:
        """Partials of those still running; one that already finished comes back through a poll."""
        return await self.engine.abort(list(request_ids))

    async def reset(self) -> None:
        """Drop every request held here and what finished unpolled. The driver calls it on an engine it took out of
        service: an actor that was only unavailable for a moment (ActorUnavailableError) still runs the requests
        the driver has taken back, and their copies sent again must not meet these ("already in flight")."""
        await self.engine.abort(list(self.futures))
        self.done.clear()

    async def load_weights(self, weights: Mapping[str, Any], version: int) -> int:
        """Swap the weights between two decoding steps: running requests go on with their KV cache."""
        await self.engine.load_weights(weights, version)
        return version

    async def load_versioned(self, versioned: tuple[int, Mapping[str, Any]]) -> int:
        """load_weights of (version, weights) as the trainer labeled them (TrainerActor.versioned_weights)."""
        return await self.load_weights(versioned[1], versioned[0])

    async def join_weight_group(self, spec: Any, rank: int) -> None:
        """Leave the weight group this actor is in, if any, and join generation `spec` as `rank` (blocks, off
        the event loop, until every member has joined)."""
        from flashreinforce.rollout.weight_broadcast import WeightGroup

        self.leave_weight_group()
        self.weight_group = await asyncio.to_thread(WeightGroup, spec, rank)

    async def receive_weights(self) -> int:
        """Take rank 0's broadcast (off the event loop: polls go on being answered) and load it; its version.
        A failed receive leaves the group (the driver builds a new one) and raises."""
        try:
            version, weights = await asyncio.to_thread(self.weight_group.receive)
        except BaseException:
            self.leave_weight_group()
            raise
        return await self.load_weights(weights, version)

    def leave_weight_group(self) -> None:
        if self.weight_group is not None:
            self.weight_group.close()
            self.weight_group = None

    async def ping(self) -> int:
        """The engine's weight version: an answer at all means the actor's event loop is alive."""
        return self.engine.version

    def _report(self) -> EngineReport:
        done, self.done = self.done, []
        return EngineReport(done, self.engine.stats, self.engine.version)


class TrainerActor:
    """One trainer rank: `factory(config, policy, group)` builds its Trainer in setup(), after rank 0 has
    chosen where the group meets (rendezvous); group None is a trainer of one rank, outside torch.distributed.

    A synchronous actor: one call at a time, as a Trainer expects.
    """

    def __init__(self, threads: int, factory: Callable[..., Any], config: Any, policy: Any) -> None:
        import torch

        torch.set_num_threads(threads)
        self.factory, self.config, self.policy = factory, config, policy
        self.trainer: Any = None
        self.store: Any = None
        """Rank 0's rendezvous store (torch.distributed.TCPStore), kept open as long as the group."""
        self.weight_store: Any = None
        """Rank 0's store of the weight group (backend.weight_sync=broadcast), open while a generation lives."""
        self.weight_group: Any = None

    def rendezvous(self) -> str:
        """Asked of rank 0: a rendezvous store this actor holds open on its node, at a port the OS picked as it
        bound (no other process can take it meanwhile); its tcp:// address, reachable from every machine."""
        from flashreinforce.trainer.distributed import launcher_store

        self.store, address = launcher_store(ray.util.get_node_ip_address())
        return address

    def setup(self, group: Any) -> int:
        """Build the Trainer (a rank joins its group here, blocking until every rank has); its version."""
        self.trainer = self.factory(self.config, self.policy, group)
        self.policy = None  # its model is the trainer's now
        return self.trainer.version

    def step(self, batch: Sequence[Trajectory]) -> tuple[dict[str, float], int]:
        metrics = self.trainer.step(batch)
        return metrics, self.trainer.version

    def weights(self) -> dict[str, Any]:
        """The weights engines load (on the CPU: an engine may be on another machine or device); a tied weight is
        one tensor under both its names, so it goes through the object store once."""
        from flashreinforce.rollout.weight_broadcast import copied_once

        return copied_once(self.trainer.weights(), lambda tensor: tensor.detach().cpu())

    def push(self, base: bool) -> dict[str, Any]:
        """What engines load at a push (Trainer.push_state: the weights, or with LoRA the adapter, with the base when
        `base`), on the CPU and a tied weight once, as weights() gives them."""
        from flashreinforce.rollout.weight_broadcast import copied_once

        return copied_once(self.trainer.push_state(base), lambda tensor: tensor.detach().cpu())

    def versioned_weights(self, base: bool = True) -> tuple[int, dict[str, Any]]:
        """(version, push(base)): with the base, what a restarting engine loads (built from the starting policy, it
        holds no base an adapter could be merged into), labeled here so the label cannot lag a step."""
        return self.trainer.version, self.push(base)

    def open_weight_group(self) -> str:
        """Asked of rank 0: a fresh store for a new generation of the weight group (the last one is left); its
        tcp:// address."""
        from flashreinforce.trainer.distributed import launcher_store

        self.leave_weight_group()
        self.weight_store, address = launcher_store(ray.util.get_node_ip_address())
        return address

    def join_weight_group(self, spec: Any) -> bool:
        """Rank 0 joins as the sender (blocks until the engines have joined). False, not an error, when they do
        not come within the group's timeout: an engine's fault must not stop the trainer."""
        from flashreinforce.rollout.weight_broadcast import WeightGroup

        try:
            self.weight_group = WeightGroup(spec, rank=0)
        except Exception:  # noqa: BLE001 - the driver counts it and falls back to the object store
            self.leave_weight_group()
            return False
        return True

    def broadcast_weights(self, base: bool) -> int | None:
        """Rank 0: the current push (push(base)) to every engine of the weight group; their version, or None when
        the send failed (a peer gone mid-push: the group is left and the driver falls back). Sharded, the other
        ranks call push(base) at the same time: gathering the full weights is a collective."""
        weights = self.trainer.push_state(base)
        try:
            self.weight_group.send(weights, self.trainer.version)
        except Exception:  # noqa: BLE001 - as in join_weight_group
            self.leave_weight_group()
            return None
        return self.trainer.version

    def leave_weight_group(self) -> None:
        if self.weight_group is not None:
            self.weight_group.close()
        self.weight_group = self.weight_store = None

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> int:
        self.trainer.load_state_dict(state)
        return self.trainer.version

    def model_files(self) -> dict[str, bytes]:
        """The saved model's files by relative path: the driver writes them into its checkpoint, which may be
        on another machine than this actor."""
        with tempfile.TemporaryDirectory(prefix="flashreinforce-model-") as scratch:
            self.trainer.save_model(Path(scratch))
            return {str(path.relative_to(scratch)): path.read_bytes()
                    for path in sorted(Path(scratch).rglob("*")) if path.is_file()}


class VerifierActor:
    """A VerifierPool (`factory(**options)`: worker processes with timeouts and memory caps for user code)."""

    def __init__(self, factory: Callable[..., Any], options: Mapping[str, Any]) -> None:
        self.pool = factory(**options)

    async def score(self, completions: Sequence[str], prompts: Sequence[Prompt]) -> tuple[list[Verdict],
                                                                                          dict[str, float]]:
        """Verdicts in order (user code failures are Verdicts), and the pool's counters after them."""
        verdicts = await self.pool.score_many(completions, prompts)
        return verdicts, self.pool.stats()

    async def ping(self) -> bool:
        return True
