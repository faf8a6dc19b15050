"""The config and assembly of env.kind=verifiers and openenv (no extra needed): the prompts' kind and reward they
take, the errors that name the fix, a verifiers task played through the endpoint by the built-in adapter, an
OpenEnv task by the environment pool, and OpenEnv's seeded prompts."""

import importlib.util

import pytest

from flashreinforce.config import load_config
from flashreinforce.envs.agent_worker import BuiltinAgent, build_agent, describe_agent
from flashreinforce.run import backends
from flashreinforce.run.backends import env_specs
from flashreinforce.run.data import load_data
from flashreinforce.run.endpoint import agent_functions, check_endpoint, serves_endpoint

VERIFIERS = ["model.path=some-model", "env.kind=verifiers", "env.options={taskset: {id: vf_sums}}", "data.kind=env",
             "env.reward=env"]
OPENENV = ["model.path=some-model", "env.kind=openenv", "env.options={env: 'my_env:MyEnv'}", "data.kind=env"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.path=m", "data.kind=env"], "data.kind=env takes the prompts from the environment: set env.kind=verifiers"),
    (["model.path=m", "env.kind=verifiers", "env.reward=env"], "set data.kind=env"),
    (["model.path=m", "env.kind=verifiers", "data.kind=env"], "scored by its environment's rubric: set env.reward=env"),
    (["env.kind=openenv", "data.kind=env"], "model.path is required with data.kind=env"),
])
def test_the_environments_prompts_and_reward_go_with_its_kind(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_a_verifiers_task_runs_through_the_endpoint_and_an_openenv_one_in_the_environment_pool(monkeypatch):
    config = load_config(None, [*VERIFIERS, "data.env.eval={split: test}"])
    assert serves_endpoint(config) and env_specs(config) == {}
    spec = agent_functions(config)[""]
    options = {"env": {"taskset": {"id": "vf_sums"}}, "eval": {"split": "test"}}
    assert spec == BuiltinAgent("flashreinforce.envs.verifiers_env:make_agent", options, "env.kind=verifiers")
    assert describe_agent(spec) == "env.kind=verifiers" and describe_agent("a.py:run") == "env.agent='a.py:run'"
    monkeypatch.setattr(backends, "EpisodeBackend", lambda *args, **kwargs: kwargs)  # what it would be given
    routes = backends.build_episode_backend(config, None, None, None, max_context=64)["tasks"]
    assert routes[""].agent and routes[""].renderer is None
    openenv = load_config(None, OPENENV)
    assert not serves_endpoint(openenv) and env_specs(openenv)[""].kind == "openenv"


def test_a_built_in_agent_is_its_factory_called_with_its_options():
    run = build_agent(BuiltinAgent("builtins:dict", {"env": 1}, "x"))
    assert run == {"env": 1}  # dict(options): the factory's return is the episode function


def test_a_verifiers_run_without_its_extra_says_which_to_install(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("aiohttp", "openai") else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"env.kind=verifiers needs aiohttp and openai: pip install -e '.\[verifiers"):
        check_endpoint(load_config(None, VERIFIERS))


def test_openenv_prompts_are_seeded_episodes_with_the_instruction():
    data = load_data(load_config(None, [*OPENENV, "data.env.num_train=5", "data.env.num_eval=2",
                                        "data.env.instruction=Guess."]))
    assert [p.id for p in data.train] == [f"train/{k:06d}" for k in range(5)] and len(data.eval) == 2
    assert data.train[0].prompt == ({"role": "user", "content": "Guess."},) and data.train[0].data_source == "openenv"
