"""The Ray backend's settings, how a run joins (or starts) Ray, and the deadline of an actor's start.

Shared by the backend (ray_backend.py: the engines), its trainer ranks (ray_trainer.py) and verifier actors
(ray_verifiers.py), so none of them imports another.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

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
    sharded_trainer: bool
    """trainer.sharding=fsdp with several ranks: reading weights, state or the model is a collective of all."""
    rollout_device: str
    """rollout.device: auto until resolve_devices() has read the cluster's GPUs, then cpu or cuda."""
    trainer_device: str
    """trainer.device, likewise."""
    weight_sync: str
    """backend.weight_sync: object_store or broadcast (controller/ray_weights.py); auto until resolved."""
    verifier_workers: tuple[int, int]
    """(min, max) verifier actors."""
    env_workers: int
    """The most environment worker actors a multi-turn run starts (controller/ray_envs.py; 0 for single-turn)."""
    verifier_timeout_s: float
    health_timeout_s: float
    step_timeout_s: float
    torch_threads: int
    adapter_pushes: bool = False
    """trainer.lora: pushes carry the adapter alone after a first one with the base (models/adapter_push.py)."""

    @property
    def engine_gpus(self) -> float:
        return self._gpus("rollout.device", self.rollout_device)

    @property
    def trainer_gpus(self) -> float:
        return self._gpus("trainer.device", self.trainer_device)

    @property
    def rank_backend(self) -> str:
        """torch.distributed backend of the trainer ranks: gloo (CPU) or nccl (GPU)."""
        return "nccl" if self.trainer_gpus else "gloo"

    @property
    def weight_backend(self) -> str:
        """torch.distributed backend of the weight group: nccl when every member is on a GPU, else gloo."""
        return "nccl" if self.engine_gpus and self.trainer_gpus else "gloo"

    def actor_options(self, role: Literal["engine", "trainer"], name: str) -> dict[str, Any]:
        """Ray's options for an engine actor or a trainer rank actor: 1 CPU, and a GPU where its side is on cuda.
        Ray restarts a dead engine however often (the backend gives up after a few failed tries); a trainer rank
        is never restarted (its group would wait for it forever: the run stops and resumes instead)."""
        gpus = self.engine_gpus if role == "engine" else self.trainer_gpus
        return {"name": name, "num_cpus": 1, "num_gpus": gpus, "max_restarts": -1 if role == "engine" else 0}

    @staticmethod
    def _gpus(field: str, device: str) -> float:
        if device == "auto":
            raise RuntimeError(f"{field}=auto is resolved against the cluster first (resolve_devices): an actor asked "
                               "for before that would get no GPU on a GPU cluster")
        return float(device == "cuda")


def resolve_devices(settings: RaySettings, cluster_resources: Mapping[str, float]) -> RaySettings:
    """`settings` with auto sides and weight_sync resolved against the cluster the run is connected to
    (`ray.cluster_resources()`): a side at auto computes on cuda when the cluster has GPUs, and weight_sync=auto
    broadcasts (NCCL) when both sides are on cuda, else goes through the object store. The actors resolve their
    own auto device as well, and find the GPU Ray gave them. Resolved settings come back unchanged."""
    gpus = int(cluster_resources.get("GPU", 0))
    sides = {"rollout.device": settings.rollout_device, "trainer.device": settings.trainer_device}
    for field, device in sides.items():
        if device == "cuda" and gpus == 0:
            raise ValueError(f"{field}=cuda, but the Ray cluster has no GPU (its resources: "
                             f"{_resources(cluster_resources)}): join a cluster with GPUs (backend.address), or set "
                             f"{field}=auto (cuda where the cluster has GPUs, else cpu) or {field}=cpu")
    rollout, trainer = (device if device != "auto" else "cuda" if gpus else "cpu" for device in sides.values())
    wanted = settings.num_engines * (rollout == "cuda") + settings.world_size * (trainer == "cuda")
    if wanted > gpus:
        raise ValueError(f"the engine and trainer actors on cuda need {wanted} GPUs (one each: "
                         f"backend.num_engines={settings.num_engines}, trainer.world_size={settings.world_size}) but "
                         f"the Ray cluster has {gpus}: lower them, set rollout.device=cpu or trainer.device=cpu, or "
                         "use backend.kind=local (one process: the engine and the trainer share a GPU)")
    sync = settings.weight_sync
    if sync == "auto":
        sync = "broadcast" if rollout == trainer == "cuda" else "object_store"
    return dataclasses.replace(settings, rollout_device=rollout, trainer_device=trainer, weight_sync=sync)


def _resources(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {value:g}" for name, value in sorted(resources.items())
                     if not name.startswith(("node:", "memory", "object_store_memory"))) or "none"


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
                           "it asks for (1 CPU each actor, +1 GPU for each engine and trainer rank on cuda); "
                           "`ray status` shows what is free") from error
    except RayError as error:
        raise RuntimeError(f"{what} failed to start: {brief(error)}") from error


def brief(error: Exception) -> str:
    """A Ray error in one line: what the actor raised, or what Ray says of a dead actor (without its ids)."""
    if isinstance(error, RayTaskError):
        return f"{type(error.cause).__name__}: {error.cause}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and not line.startswith("\t")]
    return " ".join(dict.fromkeys(lines[:1] + lines[-1:])) or type(error).__name__
