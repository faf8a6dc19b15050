"""rollout.engine=vllm without vLLM installed: a clear error naming the setup command, before any work."""

import sys

import pytest

from flashreinforce.config import load_config
from flashreinforce.rollout.vllm_engine import import_vllm
from flashreinforce.run.engines import EngineShape, build_engine
from flashreinforce.run.policy import tiny_policy


@pytest.fixture
def no_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, installed or not


def test_import_names_the_setup_command(no_vllm):
    with pytest.raises(ValueError, match="rollout.engine=vllm needs vLLM") as error:
        import_vllm()
    assert "scripts/install_vllm_cpu.sh" in str(error.value) and ".[vllm]" in str(error.value)


def test_the_builder_fails_before_starting_anything(no_vllm):
    config = load_config(None, ["rollout.engine=vllm", "model.tiny.hidden_size=32", "model.tiny.num_layers=1"])
    with pytest.raises(ValueError, match="scripts/install_vllm_cpu.sh"):
        build_engine(config, tiny_policy(config), EngineShape(longest_prompt=16, max_new_tokens=16, version=0, seed=0))


def test_config_choices_vllm_cannot_run_are_refused_first(no_vllm):
    policy_config = ["rollout.engine=vllm", "model.tiny.hidden_size=32", "model.tiny.num_layers=1"]
    shape = EngineShape(longest_prompt=16, max_new_tokens=16, version=0, seed=0)
    for override, message in (("precision.rollout=fp8", "precision.rollout"),
                              ("rollout.vllm.weight_transfer=nccl", "rollout.vllm.weight_transfer=nccl"),
                              ("model.tiny.num_experts=4", "MoE .* set trainer.router_replay=false")):
        config = load_config(None, [*policy_config, override])
        with pytest.raises((ValueError, NotImplementedError), match=message):
            build_engine(config, tiny_policy(config), shape)


def test_an_moe_model_without_router_replay_passes_the_moe_check_and_meets_the_next_one(no_vllm):
    """The qwen3_tool_ablation recipe's case: vLLM samples an MoE model whose routes the trainer picks afresh."""
    config = load_config(None, ["rollout.engine=vllm", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
                                "model.tiny.num_experts=4", "trainer.router_replay=false"])
    with pytest.raises(ValueError, match="rollout.engine=vllm needs vLLM"):
        build_engine(config, tiny_policy(config), EngineShape(longest_prompt=16, max_new_tokens=16, version=0, seed=0))
