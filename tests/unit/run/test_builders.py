"""The run layer's builders: parts this build cannot make are refused before any work, naming the field."""

import pytest

from flashreinforce.config import load_config
from flashreinforce.run import run_training
from flashreinforce.run.backends import build_episodes, check_buildable
from flashreinforce.run.engines import EngineShape, build_engine, longest_prompt
from flashreinforce.run.data import load_data
from flashreinforce.run.policy import tiny_policy


@pytest.mark.parametrize(("override", "field"), [("rollout.engine=vllm", "rollout.engine=vllm"),
                                                 ("backend.kind=ray", "backend.kind=ray"),
                                                 ("env.kind=python_tool", "env.kind=python_tool")])
def test_a_part_without_a_builder_is_refused_naming_its_field(override, field):
    with pytest.raises(ValueError, match=f"{field} is not available in this build yet; use one of"):
        check_buildable(load_config(None, [override]))


def test_a_gpu_recipe_stops_at_start_up_before_it_writes_anything(tmp_path):
    with pytest.raises(ValueError, match="is not available in this build yet"):
        run_training(load_config("r1"), run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_engine_context_is_the_longest_prompt_plus_the_budget_and_the_model_must_hold_it(tiny_run):
    config = load_config(None, tiny_run)
    policy, data = tiny_policy(config), load_data(config)
    longest = longest_prompt(config, build_episodes(config, policy.tokenizer), data)
    engine = build_engine(config, policy, EngineShape(longest, 40, version=3, seed=0))
    assert engine.max_context == longest + 40 and engine.version == 3
    assert engine.model is not policy.model  # the engine decodes its own copy of the weights
    limit = config.model.tiny.max_position_embeddings
    expected = f"max_new_tokens=200 need {longest + 200} positions but the model has {limit}"
    with pytest.raises(ValueError, match=expected):
        build_engine(config, policy, EngineShape(longest, 200, version=0, seed=0))
