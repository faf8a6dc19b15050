"""env.kind=openenv: an OpenEnv environment in-process and over its HTTP server reads the same; rendering, rewards,
seeds; every bad environment (unknown, raising at reset or mid-episode, a reward that is not a number, an action
class it does not say) is an error naming it, contained to its episode as any environment's."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from flashreinforce.envs import openenv_env
from flashreinforce.envs.openenv_env import (
    action_field_of,
    episode_seed,
    render_observation,
    seeded_prompts,
    step_reward,
)
from flashreinforce.envs.protocol import EnvSpec
from flashreinforce.envs.worker import EnvSessions
from flashreinforce.types import Prompt
from hub_envs import OPENENV_MODULE, write_hub_envs

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "hubs"


def test_an_observation_reads_as_its_one_field_or_named_lines():
    assert render_observation({"feedback": "Higher."}) == "Higher."
    assert render_observation({"feedback": "Higher.", "reward": 1.0, "done": False, "metadata": {}}) == "Higher."
    assert render_observation({"board": "x.o", "moves": [1, 2]}) == "board: x.o\nmoves: [1, 2]"
    assert render_observation({"board": "x.o", "moves": [1, 2]}, "moves") == "[1, 2]"
    with pytest.raises(KeyError, match="observation_field='score'.*board"):
        render_observation({"board": "x.o"}, "score")


def test_rewards_are_finite_numbers_or_none():
    assert step_reward(None, "e") == 0.0 and step_reward(True, "e") == 1.0 and step_reward(3, "e") == 3.0
    for bad in ("high", float("nan"), math.inf, [1]):
        with pytest.raises(TypeError, match="the env gave the reward"):
            step_reward(bad, "the env")


def test_the_text_fills_the_actions_one_required_field():
    schema = {"properties": {"metadata": {}, "guess": {}, "note": {}}, "required": ["guess"]}
    assert action_field_of(schema, "e") == "guess"
    assert action_field_of({"properties": {"metadata": {}, "code": {}}}, "e") == "code"
    with pytest.raises(ValueError, match=r"the fields \['a', 'b'\].*env.options.action_field"):
        action_field_of({"properties": {"a": {}, "b": {}}, "required": ["a", "b"]}, "e")


def test_seeded_episodes_hold_out_other_seeds():
    train, held_out = seeded_prompts("Play.", num_train=50, num_eval=10)
    assert [p.prompt for p in train + held_out] == [({"role": "user", "content": "Play."},)] * 60
    assert seeded_prompts("Play.", num_train=1, num_eval=0, chat=False)[0][0].prompt == "Play."
    seeds = {episode_seed(p.id) for p in train}
    assert len(seeds) == 50 and not seeds & {episode_seed(p.id) for p in held_out}
    assert episode_seed("train/000003") == episode_seed("train/000003")  # every sample of a prompt: one episode


@pytest.fixture
def envs_on_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(write_hub_envs(tmp_path / "envs")))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'envs'}:{EXAMPLES}")
    yield
    openenv_env._stop_servers()
    openenv_env._SERVERS.clear()
    for module in [m for m in sys.modules if m.startswith((OPENENV_MODULE, "openenv_guess"))]:
        del sys.modules[module]


def _play(env, prompt: Prompt, actions: list[str]) -> list:
    seen = [env.reset(prompt, seed=0)]
    for action in actions:
        seen.append(env.step(action))
    env.close()
    return seen


@pytest.mark.openenv
def test_in_process_and_over_its_server_an_episode_reads_the_same(envs_on_path):
    from flashreinforce.envs.openenv_env import OpenEnvEnv

    prompt, guesses = Prompt(id="train/000007", prompt="Play.", ground_truth=""), ["4", "two", "6", "7"]
    local = OpenEnvEnv(env="openenv_guess:GuessEnvironment")
    assert local.action_field == "guess"
    played = _play(local, prompt, guesses)
    assert played[0].startswith("I picked a whole number from 1 to 8")
    assert played[2].observation == "Not a number." and all(s.reward in (0.0, 1.0) for s in played[1:])
    served = OpenEnvEnv(app="openenv_guess.server:app")
    assert _play(served, prompt, guesses) == played
    process = openenv_env._SERVERS["openenv_guess.server:app"].process
    assert openenv_env._SERVERS["openenv_guess.server:app"].url.startswith("http://127.0.0.1:")
    again = OpenEnvEnv(base_url=openenv_env._SERVERS["openenv_guess.server:app"].url)  # a server already running
    assert _play(again, prompt, guesses) == played
    openenv_env._stop_servers()
    assert process.poll() is not None, "the server is stopped with its worker"


@pytest.mark.openenv
def test_bad_environments_are_named_and_end_only_their_episode(envs_on_path, tmp_path):
    def open_episode(**options):
        sessions = EnvSessions(EnvSpec(kind="openenv", options=options))
        return sessions, sessions.handle(("open", "s", Prompt(id="p", prompt="", ground_truth=""), 0, ()))

    module = f"{OPENENV_MODULE}:ParityEnvironment"
    sessions, opened = open_episode(env=module)
    assert opened == ("ok", "Say something (" + str(episode_seed("p")) + ").")
    by_file = open_episode(env=f"{tmp_path / 'envs' / OPENENV_MODULE}.py:ParityEnvironment")[1]
    assert by_file == opened, "a file path names it too"
    step = sessions.handle(("step", "s", "odd"))
    assert step[0] == "ok" and step[1].reward == 1.0 and step[1].observation == "Again." and not step[1].done
    assert open_episode(env=module, env_kwargs={"fault": "reset"})[1] == (
        "error", "RuntimeError: the parity environment cannot reset")
    for fault, why in (("step", "broke mid-episode"), ("reward", "gave the reward nan")):
        sessions, _ = open_episode(env=module, env_kwargs={"fault": fault})
        kind, message = sessions.handle(("step", "s", "a"))
        assert kind == "error" and why in message, message
        assert "s" not in sessions.envs, "the failed episode is closed; the worker goes on"
    for options, why in (({"env": "no_such_module:Env"}, "env.options.env='no_such_module:Env': No module"),
                         ({"env": f"{OPENENV_MODULE}:Nope"}, "has no 'Nope'"),
                         ({"env": "nowhere/env.py:Env"}, "env.options.env='nowhere/env.py:Env': no file"),
                         ({"env": f"{OPENENV_MODULE}:Unannotated"}, "env.options.action=package.module:MyAction"),
                         ({}, "exactly one of env.options.env"),
                         ({"env": module, "app": f"{OPENENV_MODULE}:app"}, "given: ['env', 'app']"),
                         ({"base_url": "http://127.0.0.1:9"}, "no OpenEnv server answers")):
        kind, message = open_episode(**options)[1]
        assert kind == "error" and why in message, (options, message)
    broken = f"{OPENENV_MODULE}:no_app"
    with pytest.raises(RuntimeError, match="(?s)its server exited .*has no .no_app."):
        openenv_env.local_server(broken, timeout_s=60)
