"""Data-parallel trainer ranks on one machine: `world_size` trainer processes in one torch.distributed group.

Each rank is a TrainerProcess (trainer/process.py) whose factory joins the group before it builds its Trainer
(trainer/distributed.py says how a step is split and summed). `TrainerGroup` has the methods of Trainer that
the backend calls: a step goes to every rank at once with the whole batch, and rank 0 answers for the group
(its metrics, its weights, its optimizer state; the other ranks hold the same, or with trainer.sharding=fsdp
their shards of them, gathered to rank 0 when read). A rank that fails or dies
fails the step loudly, with what happened to which rank: the others are left blocked in a collective, so the
group is closed and the run must resume from its last checkpoint (`flashreinforce train --resume <run_dir>`).

The Ray backend runs the same ranks as actors (controller/ray_trainer.py); this is the local backend's way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch

from flashreinforce.trainer.distributed import RankGroup, launcher_store
from flashreinforce.trainer.process import TrainerProcess, TrainerProcessError
from flashreinforce.trainer.trainer import Trainer
from flashreinforce.types import Trajectory

_PEER_GRACE_S = 2.0
"""After one rank fails, how long the others get to report their own failure before they are killed."""


class TrainerRankError(RuntimeError):
    """A data-parallel rank failed or died during a call; the group cannot go on."""


class TrainerGroup:
    """`world_size` ranks, each `factory(*args, RankGroup(rank, ...))` in a process of its own."""

    def __init__(self, factory: Callable[..., Trainer], args: tuple, *, world_size: int, backend: str,
                 threads: int, sharded: bool = False) -> None:
        """`sharded`: the ranks' trainers are FSDP-sharded (trainer/sharding.py), so reading their optimizer
        state or saving the model is a collective that every rank joins (rank 0 still answers)."""
        self.sharded = sharded
        self._store, init_method = launcher_store()
        self._pool = ThreadPoolExecutor(max_workers=world_size, thread_name_prefix="trainer-rank")
        # The ranks join the group in their constructors, which block until all have: start them together.
        # Built in the pool's threads, which live as long as the group: a rank's process dies with the thread
        # that built it (lifetime.die_with_parent).
        # Only rank 0's weights are read (every rank holds the same): the others publish none.
        starts = [self._pool.submit(TrainerProcess, factory, (*args, RankGroup(rank, world_size, init_method,
                                                                                 backend, launcher_store=True)),
                                    publishes=rank == 0, threads=threads)
                  for rank in range(world_size)]
        first = wait(starts, return_when=FIRST_EXCEPTION)
        if first.not_done:
            # A rank failed before the others joined: they would wait for it until join_group's timeout (300 s).
            # Closing the rendezvous store they wait on fails their join at once.
            self._store = None
        wait(starts)
        self.ranks: list[TrainerProcess] = [s.result() for s in starts if s.exception() is None]
        failed = {rank: s.exception() for rank, s in enumerate(starts) if s.exception() is not None}
        if failed:
            self.close()
            # Every rank's reason, the ones that broke first named as such: the others only lost their peer.
            reasons = "; ".join(f"rank {rank}{' (first)' if first.not_done and starts[rank] in first.done else ''}: "
                                f"{type(e).__name__}: {e}" for rank, e in failed.items())
            raise TrainerRankError(f"{len(failed)} of {world_size} data-parallel trainer ranks failed to start: "
                                   f"{reasons}") from next(iter(failed.values()))

    @property
    def version(self) -> int:
        return self.ranks[0].version

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        batch = list(trajectories)
        return self._gather("step", [lambda r=r: r.step(batch) for r in self.ranks])[0]

    def weights(self) -> dict[str, torch.Tensor]:
        return self.ranks[0].weights()

    def push_state(self, base: bool = True) -> dict[str, torch.Tensor]:
        return self.ranks[0].push_state(base)

    def state_dict(self) -> dict[str, Any]:
        if self.sharded:
            return self._gather("state_dict", [r.state_dict for r in self.ranks])[0]
        return self.ranks[0].state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._gather("load_state_dict", [lambda r=r: r.load_state_dict(state) for r in self.ranks])

    def save_model(self, directory: Path) -> None:
        if self.sharded:
            self._gather("save_model", [lambda r=r: r.save_model(directory) for r in self.ranks])
            return
        self.ranks[0].save_model(directory)

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()
        self._pool.shutdown()

    def _gather(self, command: str, calls: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run one call per rank concurrently; every rank's answer, or TrainerRankError naming the rank that
        failed first in cause (a dead process before a peer's failed collective) and every other failure."""
        futures = [self._pool.submit(call) for call in calls]
        wait(futures, return_when=FIRST_EXCEPTION)
        if all(future.done() and future.exception() is None for future in futures):
            return [future.result() for future in futures]
        wait(futures, timeout=_PEER_GRACE_S)  # the peers of a lost rank fail in their next collective
        failures = {rank: f.exception() for rank, f in enumerate(futures) if f.done() and f.exception() is not None}
        for rank in self.ranks:  # the rest would wait in a collective for the lost rank forever
            rank.kill()
        wait(futures)
        ordered = sorted(failures.items(), key=lambda item: not isinstance(item[1], TrainerProcessError))
        (first, error), others = ordered[0], ordered[1:]
        also = "".join(f"; also rank {rank}: {type(e).__name__}: {e}" for rank, e in others)
        raise TrainerRankError(
            f"data-parallel trainer rank {first} of {len(calls)} failed during {command!r}: "
            f"{type(error).__name__}: {error}{also}. The group is closed; `flashreinforce train --resume <run_dir>` "
            "continues from the last checkpoint") from error
