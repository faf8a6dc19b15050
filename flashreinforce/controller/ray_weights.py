"""backend.weight_sync=broadcast as the driver sees it: the weight group's generations (rank 0 of the trainer
and the healthy engines; rollout/weight_broadcast.py) and one push through it.

The group is the fast path, never the only one: a push whose group cannot be built, or that an engine does not
confirm, is reported engine by engine, and the backend loads those engines through the object store as it
would without a group (controller/ray_backend.py). A group has fixed members, so a lost engine ends its
generation and the next push builds a new one of the engines healthy then. After MAX_FAILURES failed pushes
in a row the broadcast is given up for the run (a network that does not let the engines reach rank 0, say)
and every push goes through the object store.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from flashreinforce.controller.ray_trainer import RayTrainer
from flashreinforce.rollout.weight_broadcast import WeightGroupSpec

log = logging.getLogger(__name__)

MAX_FAILURES = 3

Ask = Callable[[Any, Any, str, float], Awaitable[Any]]
"""RayBackend._ask: (engine, ref, what, timeout_s) -> the answer, or raises EngineLost."""


class WeightBroadcaster:
    """The weight group of one run: who is in the current generation, and pushes through it."""

    def __init__(self, trainer: RayTrainer, backend: str, timeout_s: float) -> None:
        self.trainer, self.backend, self.timeout_s = trainer, backend, timeout_s
        self.generation = 0
        self.members: tuple[Any, ...] = ()
        """The engines of the current generation, in rank order (rank 0 is the trainer's); () when none."""
        self.failures = 0
        """Failed pushes in a row."""
        self.base_sent = False
        """The current generation got a push with the base (a LoRA trainer's later pushes carry the adapter
        alone; a new generation may hold engines that have no base yet)."""

    @property
    def usable(self) -> bool:
        return self.failures < MAX_FAILURES

    def invalidate(self) -> None:
        """A member was lost: the next push builds a new generation."""
        self.members = ()

    async def push(self, engines: Sequence[Any], ask: Ask) -> list[Any]:
        """Rank 0's current weights to `engines` (each an _Engine of the backend), building the group first
        when its members are not these. Each engine's answer in order: the version it loaded, EngineLost, or
        anything else when it did not get them (an error, or None when the group was not built)."""
        if tuple(engines) != self.members:
            joins = await self._build(engines, ask)
            if tuple(engines) != self.members:
                return self._failed(joins, "joining")
        sent = self.trainer.broadcast_ref(not self.base_sent)
        # Twice the group's own timeout: a member that waits for a gone peer raises first and says so.
        answers = await asyncio.gather(*(ask(e, e.actor.receive_weights.remote(), "receive_weights",
                                             2 * self.timeout_s) for e in engines), return_exceptions=True)
        version = await self._rank_0(sent)
        if version is None or any(answer != version for answer in answers):
            return self._failed(answers, "the push")
        self.failures, self.base_sent = 0, True
        return answers

    async def _build(self, engines: Sequence[Any], ask: Ask) -> list[Any]:
        """A new generation of `engines`; each one's answer to joining (None when it joined)."""
        self.members, self.generation, self.base_sent = (), self.generation + 1, False
        address = await asyncio.to_thread(self.trainer.open_weight_group)
        spec = WeightGroupSpec(address, self.generation, len(engines) + 1, self.backend, self.timeout_s)
        joined = self.trainer.join_weight_group_ref(spec)
        joins = await asyncio.gather(*(ask(e, e.actor.join_weight_group.remote(spec, rank), "join_weight_group",
                                           2 * self.timeout_s) for rank, e in enumerate(engines, start=1)),
                                     return_exceptions=True)
        if await self._rank_0(joined) and all(answer is None for answer in joins):
            self.members = tuple(engines)
        return joins

    async def _rank_0(self, ref: Any) -> Any:
        """Rank 0's answer to a group call (False or None when it failed). A dead or failing rank 0 reads as a
        failed push here; the trainer's own next call reports it as the run's error."""
        try:
            return await asyncio.wait_for(ref, 3 * self.timeout_s)
        except Exception:  # noqa: BLE001 - see above
            return None

    def _failed(self, answers: list[Any], during: str) -> list[Any]:
        self.failures += 1
        self.members = ()
        reasons = sorted({f"{type(a).__name__}: {a}" for a in answers if isinstance(a, BaseException)})
        log.warning("the weight broadcast failed during %s (%d in a row%s)%s; these weights go through the object "
                    "store", during, self.failures, ", giving it up for this run" if not self.usable else "",
                    f": {'; '.join(reasons)}" if reasons else "")
        return answers
