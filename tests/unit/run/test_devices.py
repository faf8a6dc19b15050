"""trainer.device / rollout.device: auto follows the machine, cuda without a GPU is refused naming the field."""

import pytest
import torch

from flashreinforce.config import load_config
from flashreinforce.run.devices import resolve_device, thread_oversubscription
from flashreinforce.run.learner import build_trainer
from flashreinforce.run.policy import tiny_policy


def test_auto_is_cpu_without_a_gpu_and_cpu_is_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("trainer.device", "auto") == torch.device("cpu")
    assert resolve_device("rollout.device", "cpu") == torch.device("cpu")


def test_cuda_without_a_gpu_names_the_field_and_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"rollout.device=cuda but torch sees no GPU.*set rollout.device=cpu"):
        resolve_device("rollout.device", "cuda")


def test_data_parallel_ranks_take_one_gpu_each(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [resolve_device("trainer.device", "auto", rank=r) for r in range(3)] == [
        torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 0)]


def test_the_trainer_computes_on_its_device(tiny_run):
    config = load_config(None, [*tiny_run, "trainer.device=cpu"])
    policy = tiny_policy(config)
    trainer = build_trainer(config, policy.model, policy.tokenizer)
    assert trainer.device == torch.device("cpu") and next(trainer.model.parameters()).device.type == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/device_checks.sh)")
def test_the_trainer_and_engine_compute_on_the_gpu(tiny_run):
    from flashreinforce.run.backends import build_episodes
    from flashreinforce.run.data import load_data
    from flashreinforce.run.engines import EngineShape, build_engine, longest_prompt

    config = load_config(None, [*tiny_run, "trainer.device=cuda", "rollout.device=cuda"])
    policy = tiny_policy(config)
    trainer = build_trainer(config, policy.model, policy.tokenizer)
    shape = EngineShape.of(longest_prompt(config, build_episodes(config, policy.tokenizer), load_data(config)), 16, 0, 0)
    engine = build_engine(config, policy, shape)
    assert next(trainer.model.parameters()).is_cuda and next(engine.model.parameters()).is_cuda


@pytest.mark.parametrize(("overrides", "cores", "warned"), [
    ([], 2, False),                                             # the default: one thread each side fills 2 cores
    (["backend.torch_threads=2"], 2, True),                     # 2 + 2 on 2 cores
    (["backend.torch_threads=2"], 4, False),
    (["backend.torch_threads=2", "deterministic=true"], 2, False),  # lockstep: one side computes at a time
    (["backend.torch_threads=2", "trainer.world_size=2"], 2, False),  # ranks are processes of their own
    (["backend.torch_threads=2", "backend.trainer_process=true"], 2, False),  # so is this trainer
])
def test_the_overlapped_loop_warns_when_its_two_sides_threads_exceed_the_cores(monkeypatch, overrides, cores, warned):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = thread_oversubscription(load_config("arithmetic", overrides), cores)
    assert (message is not None) == warned
    if warned:
        assert "backend.torch_threads=2" in message and "Set backend.torch_threads=1" in message
        assert "deterministic=true" in message


def test_on_a_gpu_the_threads_are_not_the_engine_and_trainer_compute(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert thread_oversubscription(load_config("arithmetic", ["backend.torch_threads=4"]), 2) is None
