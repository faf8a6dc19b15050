"""env.kind=verifiers against the real library: a taskset's tasks as the run's prompts (train, held out from its eval
split or after the training ones), an episode relayed to the episode's base URL and scored by the rubric, and every
bad environment (an unknown id, one that raises at load, mid-episode, a reward that is not a number) an error that
names it."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import pytest

from hub_envs import VERIFIERS_PACKAGE, write_hub_envs

pytestmark = [pytest.mark.verifiers, pytest.mark.endpoint]  # aiohttp and openai: the verifiers extra brings them

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "hubs"
SUMS = {"taskset": {"id": "vf_sums", "size": 12}, "agent": {"runtime": {"type": "subprocess"}}}
PARITY = {"taskset": {"id": VERIFIERS_PACKAGE, "size": 6}, "agent": {"runtime": {"type": "subprocess"}}}


@pytest.fixture(autouse=True)
def envs_on_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(write_hub_envs(tmp_path / "envs")))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield
    for module in [m for m in sys.modules if m.startswith((VERIFIERS_PACKAGE, "vf_sums"))]:
        del sys.modules[module]


def _parity(**taskset) -> dict:
    return {**PARITY, "taskset": {**PARITY["taskset"], **taskset}}


def test_the_tasksets_tasks_are_the_prompts():
    from flashreinforce.envs.verifiers_env import taskset_prompts

    train, held_out = taskset_prompts(SUMS, num_train=5, num_eval=3, eval_overrides={"split": "test"})
    assert [p.id for p in train] == [f"train/{k:06d}" for k in range(5)] and len(held_out) == 3
    assert train[0].data_source == "vf_sums" and train[0].prompt[0]["role"] == "user"
    assert train[0].prompt[0]["content"].startswith("What is ") and held_out[0].id == "eval/000000"
    assert {p.ground_truth for p in train}.isdisjoint({p.ground_truth for p in held_out}), "the test split differs"
    carried = json.loads(held_out[1].ground_truth)
    assert carried["split"] == "eval" and carried["task"]["prompt"] == held_out[1].prompt[0]["content"]
    train, held_out = taskset_prompts(SUMS, num_train=None, num_eval=4, eval_overrides=None)  # the tail held out
    assert len(train) == 8 and len(held_out) == 4
    assert json.loads(held_out[0].ground_truth)["task"]["idx"] == 8


def test_an_unknown_or_broken_environment_is_named():
    from flashreinforce.envs.verifiers_env import taskset_prompts

    def prompts(options):
        return taskset_prompts(options, num_train=2, num_eval=1, eval_overrides=None)

    with pytest.raises(ValueError, match="env.options.taskset.id='no-such-env'.*not found.*PYTHONPATH"):
        prompts({"taskset": {"id": "no-such-env"}})
    with pytest.raises(ValueError, match="set env.options.taskset.id"):
        prompts({"agent": {}})
    with pytest.raises(ValueError, match=f"taskset '{VERIFIERS_PACKAGE}' raised while loading: RuntimeError: the "
                                         "parity taskset cannot load"):
        prompts(_parity(fault="load"))
    with pytest.raises(ValueError, match="raised while loading its tasks: RuntimeError: .* third task"):
        prompts(_parity(fault="tasks"))
    with pytest.raises(ValueError, match="(?s)env.options .*config.*size"):
        prompts(_parity(size="many"))


class _Model:
    """An OpenAI-compatible chat server on loopback answering each call with the next reply; records the calls."""

    def __init__(self, replies: list[str]) -> None:
        self.replies, self.calls = replies, []

    async def __aenter__(self) -> str:
        from aiohttp import web

        async def chat(request):
            body = await request.json()
            self.calls.append((request.match_info["episode"], request.headers["Authorization"], body["messages"]))
            text = self.replies[(len(self.calls) - 1) % len(self.replies)]
            return web.json_response({"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                                      "choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": text}}],
                                      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        app = web.Application()
        app.router.add_post("/episodes/{episode}/v1/chat/completions", chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *_) -> None:
        await self.runner.cleanup()


def _episodes(options: dict, rows, replies: list[str]):
    """Each row's episode through make_agent (as an agent worker runs it), with an openai client per episode."""
    import openai

    from flashreinforce.envs.verifiers_env import make_agent

    async def go():
        run, model, results = make_agent({"env": options, "eval": None}), _Model(replies), []
        async with model as url:
            for k, row in enumerate(rows):
                client = openai.AsyncOpenAI(base_url=f"{url}/episodes/e{k}/v1", api_key="the-key")
                try:
                    results.append(await run(client, {"id": row.id, "ground_truth": row.ground_truth}))
                except Exception as error:  # noqa: BLE001 - the test reads what the agent pool would
                    results.append(error)
            clients = [len(server.clients) for server in run.__self__.env._interception.servers]
            await run.__self__.close()
        return results, model.calls, clients

    return asyncio.run(go())


def test_an_episode_is_relayed_to_its_base_url_and_scored_by_the_rubric():
    from flashreinforce.envs.verifiers_env import taskset_prompts

    train, _ = taskset_prompts(SUMS, num_train=2, num_eval=0, eval_overrides=None)
    answers = [json.loads(p.ground_truth)["task"]["answer"] for p in train]
    results, calls, clients = _episodes(SUMS, train, ["I think", answers[0], "7 maybe", "still no"])
    assert results == [{"reward": 1.0}, {"reward": 0.0}]
    assert [(e, key) for e, key, _ in calls] == [("e0", "Bearer the-key")] * 2 + [("e1", "Bearer the-key")] * 2
    assert calls[1][2][-2:] == [{"role": "assistant", "content": "I think"},
                                {"role": "user", "content": "Reply with the number only."}], "the call continues"
    assert clients == [0], "each episode's model client is closed with it"


def test_a_failing_episode_or_a_reward_that_is_not_a_number_raises_naming_it():
    from flashreinforce.envs.verifiers_env import taskset_prompts

    for fault, why in (("episode", "failed the episode: .*the parity harness broke mid-episode"),
                       ("reward", "failed the episode: .*to float: 'high' .*rewards: {'parity': None}"),
                       ("nan", r"gave the reward nan \(its rewards: \{'parity': nan\}\)")):
        options = _parity(fault=fault)
        rows, _ = taskset_prompts(options, num_train=1, num_eval=0, eval_overrides=None)
        (error,), _, _ = _episodes(options, rows, ["a reply"])
        assert isinstance(error, (RuntimeError, ValueError)), error
        assert f"the verifiers environment '{VERIFIERS_PACKAGE}'" in str(error)
        assert re.search(why, str(error)), str(error)



def test_an_agent_in_prime_sandboxes_without_a_prime_login_says_how_to_run_it_here(monkeypatch, tmp_path):
    from flashreinforce.envs.verifiers_env import make_agent

    monkeypatch.delenv("PRIME_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no Prime login there
    with pytest.raises(ValueError, match=r"runs its agent\(s\) \['agent'\] in Prime's sandboxes, and not "
                                         "authenticated with prime.*runtime says otherwise: {type: subprocess}"):
        make_agent({"env": {"taskset": PARITY["taskset"]}, "eval": None})  # verifiers' default runtime
