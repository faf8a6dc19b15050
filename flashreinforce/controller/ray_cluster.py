"""The Ray backend's settings, how a run joins (or starts) Ray, and the deadline of an actor's start.

Shared by the backend (ray_backend.py: the engines), its trainer ranks (ray_trainer.py) and verifier actors
(ray_verifiers.py), so none of them imports another.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError

START_TIMEOUT_S = 300.0  # an actor's start: a fresh interpreter importing torch and building its model


@dataclass(frozen=True)
class RaySettings:
    """The backend's flat settings (run/backends.py reads them from backend.*, trainer.*, rollout.*, verifier.*)."""

    address: str | None
    """None: start a Ray on this machine (on loopback); "auto" or host:port: join that cluster."""
    num_engines: int
    engine_slots: int
    """Requests one engine decodes together (rollout.max_batch_size)."""
    world_size: int
    rank_backend: str
    """torch.distributed backend of the trainer ranks: gloo (CPU) or nccl (GPU)."""
    sharded_trainer: bool
    """trainer.sharding=fsdp with several ranks: reading weights, state or the model is a collective of all."""
    weight_sync: str
    """object_store or broadcast (controller/ray_weights.py)."""
    weight_backend: str
    """torch.distributed backend of the weight group: nccl (every member on a GPU) or gloo."""
    engine_gpus: float
    trainer_gpus: float
    verifier_workers: tuple[int, int]
    """(min, max) verifier actors."""
    env_workers: int
    """The most environment worker actors a multi-turn run starts (controller/ray_envs.py; 0 for single-turn)."""
    verifier_timeout_s: float
    health_timeout_s: float
    step_timeout_s: float
    torch_threads: int


def start_ray(settings: RaySettings) -> Callable[[], None]:
    """Join the configured cluster, or start Ray on this machine, unless this process is connected already.
    Returns what undoes it: ray.shutdown when this call connected, else nothing."""
    # Without these Ray reports usage and may bind the machine's external interface even for a local run.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return lambda: None
    if settings.address is None:
        # Logical CPUs for scheduling only: every actor asks for one, and Ray never runs more threads for them.
        wanted = settings.num_engines + settings.world_size + settings.verifier_workers[1] + settings.env_workers
        # address="local": a Ray of its own even when `ray start` left a cluster running on this machine.
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, wanted), include_dashboard=False,
                 _node_ip_address="127.0.0.1")
    else:
        ray.init(address=settings.address)
    return ray.shutdown


def ready(ref: Any, what: str) -> Any:
    try:
        return ray.get(ref, timeout=START_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError as error:
        raise RuntimeError(f"{what} did not start within {START_TIMEOUT_S:.0f} s: the cluster may lack the resources "
                           "it asks for (1 CPU each actor, +1 GPU with rollout.device / trainer.device=cuda); "
                           "`ray status` shows what is free") from error
    except RayError as error:
        raise RuntimeError(f"{what} failed to start: {brief(error)}") from error


def brief(error: Exception) -> str:
    """A Ray error in one line: what the actor raised, or what Ray says of a dead actor (without its ids)."""
    if isinstance(error, RayTaskError):
        return f"{type(error.cause).__name__}: {error.cause}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and not line.startswith("\t")]
    return " ".join(dict.fromkeys(lines[:1] + lines[-1:])) or type(error).__name__
