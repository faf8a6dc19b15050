"""trainer.device / rollout.device: auto follows the machine, cuda without a GPU is refused naming the field."""

import pytest
import torch

from flashreinforce.config import load_config
from flashreinforce.run.devices import resolve_device
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
