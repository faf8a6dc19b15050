"""The Ray backend's trainer: data-parallel trainer rank actors behind one handle with the Trainer's face."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

from flashreinforce.controller.ray_actors import TrainerActor
from flashreinforce.controller.ray_cluster import START_TIMEOUT_S, RaySettings, brief, ready, resolve_devices
from flashreinforce.trainer.distributed import RankGroup
from flashreinforce.trainer.group import TrainerRankError
from flashreinforce.types import Trajectory


class RayTrainer:
    """The trainer ranks behind one handle with the Trainer's face (version, step, state, weights, model).

    Every rank gets the whole batch and steps at once; rank 0 answers for the group. A rank that fails, dies
    or misses backend.step_timeout_s stops the whole group (the others would wait in a collective forever):
    the call raises TrainerRankError, and the run resumes from its last checkpoint.
    """

    def __init__(self, ranks: list[Any], names: list[str], step_timeout_s: float, sharded: bool = False) -> None:
        """`sharded`: the ranks are FSDP-sharded, so a read of weights, state or model joins every rank."""
        self.ranks, self.names, self.step_timeout_s, self.sharded = ranks, names, step_timeout_s, sharded
        self._peer_reads: list[Any] = []
        """The other ranks' parts in the last sharded weights read (they answer {}): checked at the next call."""
        self.version = 0
        self._stopped: str | None = None

    @classmethod
    def start(cls, settings: RaySettings, factory: Callable[..., Any], config: Any, policy: Any,
              prefix: str) -> RayTrainer:
        settings = resolve_devices(settings, ray.cluster_resources())  # unchanged when the backend resolved them
        actor_class = ray.remote(TrainerActor)
        names = [f"{prefix}-trainer-{rank}" for rank in range(settings.world_size)]
        ranks = [actor_class.options(**settings.actor_options("trainer", name)).remote(
            settings.torch_threads, factory, config, policy) for name in names]
        trainer = cls(ranks, names, settings.step_timeout_s, settings.sharded_trainer)
        try:
            groups: list[RankGroup | None] = [None]
            if settings.world_size > 1:  # rank 0's node and a port free there, reachable from every machine
                address = ready(ranks[0].rendezvous.remote(), f"trainer actor {names[0]}")
                groups = [RankGroup(rank, settings.world_size, address, settings.rank_backend, launcher_store=True)
                          for rank in range(settings.world_size)]
            trainer.version = trainer._gather("setup", [r.setup.remote(g) for r, g in zip(ranks, groups)],
                                              START_TIMEOUT_S)[0]
        except BaseException:
            trainer.close()
            raise
        return trainer

    async def step(self, batch: Sequence[Trajectory]) -> dict[str, float]:
        batch_ref = ray.put(list(batch))  # once, for every rank
        refs = [rank.step.remote(batch_ref) for rank in self.ranks]
        answers = await asyncio.to_thread(self._gather, "step", refs, self.step_timeout_s)
        metrics, self.version = answers[0]
        return metrics

    def weights_ref(self) -> Any:
        """Rank 0's weights of `version`, as one object in the object store (every engine reads the same)."""
        return self._weights_read("weights", "weights")

    def push_ref(self, base: bool) -> Any:
        """Rank 0's push of `version` (TrainerActor.push: with LoRA the adapter, with its base when `base`), as one
        object in the object store."""
        return self._weights_read("push", "push", base)

    async def versioned_weights(self) -> Any:
        """A ref of rank 0's (version, push with the base), once rank 0 has answered (after a step or push it may be
        running): what a restarting engine loads, its version from rank 0 itself, never a stale one from here."""
        ref = self._weights_read("versioned_weights", "push", True)
        await asyncio.to_thread(ray.wait, [ref], timeout=self.step_timeout_s, fetch_local=False)
        return ref

    def broadcast_ref(self, base: bool) -> Any:
        """Rank 0 sends its push (push_ref's) through the weight group (TrainerActor.broadcast_weights): a ref of the
        version sent, or of None when the send failed."""
        return self._weights_read("broadcast_weights", "push", base)

    def open_weight_group(self) -> str:
        """A fresh store on rank 0's node for the next generation of the weight group: its address."""
        return self._gather("open_weight_group", [self.ranks[0].open_weight_group.remote()], self.step_timeout_s)[0]

    def join_weight_group_ref(self, spec: Any) -> Any:
        """Rank 0 joins the weight group: a ref of True, or False when the engines did not come in time."""
        self._check_running("join_weight_group")
        return self.ranks[0].join_weight_group.remote(spec)

    def _weights_read(self, method: str, peer_method: str, *args: Any) -> Any:
        """Rank 0's `method` over its full weights. Sharded, every other rank takes part in gathering them by
        `peer_method` (weights or push: the same collectives as rank 0's; it answers {}, checked at the next
        call)."""
        self._check_running(method)
        peers = [getattr(rank, peer_method).remote(*args) for rank in self._readers()[1:]]
        self._peer_reads.extend(peers)
        return getattr(self.ranks[0], method).remote(*args)

    def state_dict(self) -> dict[str, Any]:
        return self._gather("state_dict", [r.state_dict.remote() for r in self._readers()], self.step_timeout_s)[0]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state_ref = ray.put(dict(state))
        self.version = self._gather("load_state_dict", [r.load_state_dict.remote(state_ref) for r in self.ranks],
                                    self.step_timeout_s)[0]

    def model_files(self) -> dict[str, bytes]:
        return self._gather("save_model", [r.model_files.remote() for r in self._readers()], self.step_timeout_s)[0]

    def _readers(self) -> list[Any]:
        """The ranks that answer a read: rank 0 alone, or every rank when the read is a collective (sharded)."""
        return self.ranks if self.sharded else self.ranks[:1]

    def close(self) -> None:
        for rank in self.ranks:
            ray.kill(rank, no_restart=True)

    def _check_running(self, what: str) -> None:
        if self._stopped is not None:
            raise TrainerRankError(f"the trainer group was stopped ({self._stopped}); cannot run {what!r}")

    def _gather(self, what: str, refs: list[Any], timeout_s: float) -> list[Any]:
        """Every rank's answer (refs[i] is rank i's), or TrainerRankError naming the first rank that failed (the
        group is stopped). The peers' parts of an earlier sharded weights read are waited on first."""
        self._check_running(what)
        peers, self._peer_reads = self._peer_reads, []
        ranks = {ref: rank for rank, ref in enumerate(refs)}
        ranks.update({ref: 1 + i % (len(self.ranks) - 1) for i, ref in enumerate(peers)})
        deadline, remaining = time.monotonic() + timeout_s, [*peers, *refs]
        while remaining:
            ready, remaining = ray.wait(remaining, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._fail(what, ranks[remaining[0]], f"did not answer within {timeout_s:.0f} s "
                           "(backend.step_timeout_s)", None)
            try:
                ray.get(ready[0])
            except RayActorError as error:
                self._fail(what, ranks[ready[0]], f"died ({brief(error)})", error)
            except RayError as error:
                self._fail(what, ranks[ready[0]], f"failed ({brief(error)})", error)
        return ray.get(refs)

    def _fail(self, what: str, rank: int, how: str, error: Exception | None) -> None:
        self._stopped = f"rank {rank} {how}"
        self.close()
        raise TrainerRankError(
            f"trainer rank {rank} of {len(self.ranks)} (Ray actor {self.names[rank]}) {how} during {what!r}. The "
            "trainer group is stopped (the other ranks would wait for it forever); `flashreinforce train --resume "
            "<run_dir>` continues the run from its last checkpoint") from error
