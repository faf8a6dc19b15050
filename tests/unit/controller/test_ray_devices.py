"""The Ray backend's devices against the cluster a run connects to (controller/ray_cluster.py resolve_devices):
a side left at auto computes on GPUs when the cluster has them, its actors ask Ray for one each, and the weight
push then goes by broadcast over NCCL. The cluster's resource table is faked: no GPU and no Ray start needed."""

import pytest

pytest.importorskip("ray")

from flashreinforce.config import load_config
from flashreinforce.controller.ray_cluster import resolve_devices
from flashreinforce.run.backends import ray_settings

pytestmark = pytest.mark.ray

GPUS = {"CPU": 16.0, "GPU": 8.0, "memory": 1e11, "node:127.0.0.1": 1.0}
CPUS = {"CPU": 2.0, "memory": 1e10}


def settings(*overrides):
    return ray_settings(load_config(None, ["backend.kind=ray", *overrides]))


def test_auto_on_a_gpu_cluster_gives_every_engine_and_rank_a_gpu_and_broadcasts_over_nccl():
    resolved = resolve_devices(settings("backend.num_engines=2", "trainer.world_size=2"), GPUS)
    assert (resolved.rollout_device, resolved.trainer_device) == ("cuda", "cuda")
    assert (resolved.weight_sync, resolved.weight_backend, resolved.rank_backend) == ("broadcast", "nccl", "nccl")
    assert resolved.actor_options("engine", "e-0")["num_gpus"] == 1.0
    assert resolved.actor_options("trainer", "t-0")["num_gpus"] == 1.0
    assert resolved.actor_options("engine", "e-0")["max_restarts"] == -1  # Ray restarts a dead engine
    assert resolved.actor_options("trainer", "t-0")["max_restarts"] == 0  # a dead rank stops the run


def test_auto_on_a_cpu_cluster_asks_for_no_gpu_and_pushes_through_the_object_store():
    resolved = resolve_devices(settings(), CPUS)
    assert (resolved.rollout_device, resolved.trainer_device) == ("cpu", "cpu")
    assert (resolved.weight_sync, resolved.weight_backend, resolved.rank_backend) == ("object_store", "gloo", "gloo")
    assert resolved.actor_options("engine", "e-0")["num_gpus"] == 0.0
    assert resolved.actor_options("trainer", "t-0")["num_gpus"] == 0.0


def test_a_side_set_to_cpu_stays_there_and_the_push_keeps_the_object_store():
    resolved = resolve_devices(settings("rollout.device=cpu"), GPUS)
    assert (resolved.rollout_device, resolved.trainer_device) == ("cpu", "cuda")
    assert (resolved.actor_options("engine", "e")["num_gpus"], resolved.actor_options("trainer", "t")["num_gpus"]) \
        == (0.0, 1.0)
    assert (resolved.weight_sync, resolved.weight_backend, resolved.rank_backend) == ("object_store", "gloo", "nccl")


def test_an_explicit_weight_sync_is_kept_on_gpus():
    resolved = resolve_devices(settings("backend.weight_sync=object_store"), GPUS)
    assert resolved.weight_sync == "object_store" and resolved.engine_gpus == 1.0


def test_resolving_twice_changes_nothing():
    once = resolve_devices(settings(), GPUS)
    assert resolve_devices(once, GPUS) == once


@pytest.mark.parametrize("field", ["rollout.device", "trainer.device"])
def test_cuda_on_a_cluster_without_gpus_is_an_error_naming_the_field(field):
    with pytest.raises(ValueError, match=rf"{field}=cuda, but the Ray cluster has no GPU .* {field}=auto"):
        resolve_devices(settings(f"{field}=cuda"), CPUS)


def test_more_gpus_than_the_cluster_has_is_an_error_naming_the_fields():
    with pytest.raises(ValueError, match=r"need 3 GPUs .*backend.num_engines=2, trainer.world_size=1.* has 2"):
        resolve_devices(settings("backend.num_engines=2"), {**CPUS, "GPU": 2.0})


def test_unresolved_settings_refuse_to_say_how_many_gpus_an_actor_gets():
    """Asking Ray for an actor before the devices are resolved is what requested no GPU on GPU clusters."""
    with pytest.raises(RuntimeError, match="resolve_devices"):
        settings().actor_options("engine", "e-0")
