"""Agent episodes (env.kind=agent) end to end below the loop: the user's agent in a worker process calls a tiny
model through the real endpoint with the `openai` client; EpisodeBackend runs them over the embedded engine.

The model may sample only whole words (" answer", " is", ...) and its end-of-turn token (every other id is banned,
in the engine and in the recompute alike), so that re-tokenizing what it sampled gives the same ids: that makes a
direct render of the conversation comparable, id for id, with the trajectory the endpoint recorded."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import string
import textwrap

import pytest
import torch

from flashreinforce.controller.agent_episodes import Settings
from flashreinforce.controller.episodes import AgentParts, EpisodeBackend, EpisodeSettings, TaskRoute
from flashreinforce.controller.local import LocalBackend
from flashreinforce.endpoint.chat import HERMES_TEMPLATE, ChatRenderer, template_messages
from flashreinforce.endpoint.openai_api import Message
from flashreinforce.endpoint.service import Endpoint
from flashreinforce.envs.agents import AgentPool
from flashreinforce.envs.single_turn import TextEpisodes, to_trajectory
from flashreinforce.models import build_model
from flashreinforce.models.logprobs import token_logprobs
from flashreinforce.rollout.engine import Engine
from flashreinforce.types import Prompt, RolloutKey, SamplingParams

pytestmark = pytest.mark.endpoint

CONTEXT = 1024
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]

AGENTS = string.Template(textwrap.dedent('''
    import asyncio, json

    TOOLS = $tools

    async def chat(client, row):
        """Three calls, each extending the last: a tool result, then a user turn, between them."""
        messages = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": row["prompt"]}]
        follow = [{"role": "tool", "tool_call_id": "c0", "content": "5"}, {"role": "user", "content": "Are you sure?"}]
        for turn in range(3):
            reply = await client.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS, max_tokens=6)
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            if turn < 2:
                messages.append(follow[turn])
        if row["ground_truth"]:
            with open(row["ground_truth"], "w") as file:
                json.dump(messages, file)
        return {"reward": float(len(messages)), "passed": True}

    async def rewrite(client, row):
        """The second call drops the first answer: a new segment."""
        first = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "start over"}])
        return 1.0

    async def fail(client, row):
        kind = row["ground_truth"]
        if kind == "raise":
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            raise ValueError("the agent gave up")
        if kind == "hang":
            await asyncio.sleep(60)
        if kind == "silent":
            return 1.0
        if kind == "bad_request":
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=3)
        if kind == "no_reward":
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            return None
        return await chat(client, {**row, "ground_truth": ""})
''')).substitute(tools=json.dumps(TOOLS))


@pytest.fixture(scope="module")
def word_model(chat_tokenizer):
    """A tiny random model that samples whole words (Ġ + letters) and <|im_end|> only."""
    tok = chat_tokenizer
    vocab = tok.get_vocab()
    allowed = {i for t, i in vocab.items() if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 2}
    allowed.add(tok.convert_tokens_to_ids("<|im_end|>"))
    model = build_model(len(tok), 32, 1, 2, CONTEXT, intermediate_size=64, pad_token_id=tok.pad_token_id,
                        eos_token_id=tok.eos_token_id)
    model.banned_token_ids = tuple(sorted(set(range(len(tok))) - allowed))
    assert len(allowed) > 10
    return model


@pytest.fixture
def agents_file(tmp_path):
    path = tmp_path / "agents.py"
    path.write_text(AGENTS)
    return path


class NoVerifiers:
    """The verifier pool's place: these agents give their own reward (env.reward=env), nothing is scored."""

    def stats(self) -> dict[str, float]:
        return {}


@contextlib.asynccontextmanager
async def agent_backend(model, tok, function: str, *, lockstep: bool, timeout_s: float = 60.0):
    from flashreinforce.endpoint.server import EndpointServer

    engine = Engine(copy.deepcopy(model), max_batch_size=8, max_context=CONTEXT, eos_token_ids=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id, tokenizer=tok)
    inner = LocalBackend(engine, None, NoVerifiers(), tok, overlap=not lockstep)
    endpoint = Endpoint(tok, None, model_name="tiny", max_context=CONTEXT, max_new_tokens=6,
                        chat_template=HERMES_TEMPLATE)
    server = EndpointServer(endpoint, api_key="key")
    pool = AgentPool(function, timeout_s=timeout_s, max_workers=1, cancel_grace_s=0.5)
    await server.start()
    await pool.start()
    backend = EpisodeBackend(inner, TextEpisodes(tok), tasks={"": TaskRoute(reward="env", agent=True)},
                             agents=AgentParts(endpoint, pool, Settings(server.base_url, "key", lockstep)),
                             settings=EpisodeSettings(max_context=CONTEXT, lockstep=lockstep))
    try:
        yield backend, endpoint
    finally:
        await backend.close()
        await pool.aclose()
        await server.stop()


def prompt(index: int, truth: str = "") -> Prompt:
    return Prompt(f"p{index}", "What is 2+3? Answer with a number.", truth)


def params(index: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=6, seed=1000 + index)


async def run_episodes(backend, prompts, *, interrupt=None) -> dict:
    """Start an episode per prompt, wait for them all; `interrupt(backend)` runs once the first call is recorded."""
    for i, p in enumerate(prompts):
        backend.start(f"{p.id}#0", p, params(i))
    ended = {}
    while len(ended) < len(prompts):
        if interrupt is not None and backend.agents.endpoint.counts["calls"] >= 1:
            await interrupt(backend)
            interrupt = None
        for generation in await backend.finished():
            ended[generation.request_id] = generation
    verdicts = await backend.judge(list(ended.values()))
    return {rid: (g, v) for (rid, g), v in zip(ended.items(), verdicts)}


def test_an_episode_of_several_openai_calls_trains_token_exactly(word_model, chat_tokenizer, agents_file, tmp_path):
    """Its trajectory's ids are a direct render of the conversation the agent had, and its behavior log-probs are
    what the trainer's forward gives them (fp32, <= 1e-5)."""
    conversation = tmp_path / "conversation.json"

    async def main():
        async with agent_backend(word_model, chat_tokenizer, f"{agents_file}:chat", lockstep=False) as (backend, _):
            return await run_episodes(backend, [prompt(0, str(conversation))])
    ((generation, verdict),) = asyncio.run(main()).values()
    trajectory = to_trajectory(RolloutKey("p0", 0), prompt(0), 0, generation, verdict)
    assert verdict.reward == 7.0 and verdict.passed and trajectory.segments == ()
    assert len(generation.episode.calls) == 3

    messages = template_messages([Message.model_validate(m) for m in json.loads(conversation.read_text())])
    direct = ChatRenderer(chat_tokenizer, HERMES_TEMPLATE).render(messages, TOOLS, generation_prompt=False)
    tokens = list(trajectory.tokens)
    end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokens == direct[: len(tokens)]
    assert direct[len(tokens):] in ([end, *chat_tokenizer.encode("\n")], chat_tokenizer.encode("\n"))
    sampled = [j for j, m in enumerate(trajectory.loss_mask) if m]
    assert len(sampled) == sum(len(c.generation.token_ids) for c in generation.episode.calls)

    with torch.no_grad():
        recomputed, _ = token_logprobs(word_model, torch.tensor([tokens]), with_entropy=False)
    behavior = torch.tensor(trajectory.behavior_logprobs)[sampled]
    assert (recomputed[0, sampled] - behavior).abs().max() <= 1e-5


def test_a_call_that_rewrites_the_history_makes_a_second_segment_trained_beside_the_first(word_model, chat_tokenizer,
                                                                                          agents_file):
    async def main():
        async with agent_backend(word_model, chat_tokenizer, f"{agents_file}:rewrite", lockstep=True) as (backend, _):
            result = await run_episodes(backend, [prompt(0)])
            return result, backend.stats()
    result, stats = asyncio.run(main())
    ((generation, verdict),) = result.values()
    trajectory = to_trajectory(RolloutKey("p0", 0), prompt(0), 0, generation, verdict)
    assert len(trajectory.rows()) == 2 and stats["episode/segments"] == 2 and stats["episode/multi_segment"] == 1
    first, second = trajectory.rows()
    assert first.verdict == second.verdict and first.key == second.key
    assert chat_tokenizer.decode(second.tokens[: second.prompt_length]).count("start over") == 1


def test_pause_and_resume_in_the_middle_of_calls_gives_the_uninterrupted_rows(word_model, chat_tokenizer, agents_file):
    async def main(interrupt):
        async with agent_backend(word_model, chat_tokenizer, f"{agents_file}:chat", lockstep=True) as (backend, _):
            result = await run_episodes(backend, [prompt(i) for i in range(3)], interrupt=interrupt)
            return {rid: g.token_ids for rid, (g, _) in result.items()}

    async def pause_and_resume(backend):  # the first episode just ended; the others are between calls
        partials, done = await backend.pause()
        assert not done and len(partials) == 2
        assert any(c.generation.finish_reason == "abort" for p in partials for c in p.episode.calls), \
            "no call was caught in the engine"
        await backend.resume(partials)

    assert asyncio.run(main(pause_and_resume)) == asyncio.run(main(None))


def test_an_aborted_episode_restarted_from_its_record_replays_its_calls_to_the_same_rows(word_model, chat_tokenizer,
                                                                                         agents_file):
    """As a resume from a checkpoint does: the agent runs again, its recorded calls are answered from the record
    and a call caught in flight continues from its partial."""
    async def main(interrupt):
        async with agent_backend(word_model, chat_tokenizer, f"{agents_file}:chat", lockstep=True) as (backend, ep):
            result = await run_episodes(backend, [prompt(i) for i in range(3)], interrupt=interrupt)
            return {rid: g.token_ids for rid, (g, _) in result.items()}, dict(ep.counts)

    async def abort_and_restart(backend):  # one episode just ended; the others are between calls
        partials = await backend.abort(["p0#0", "p1#0", "p2#0"])
        assert len(partials) == 2
        assert any(c.generation.finish_reason == "abort" for p in partials for c in p.episode.calls)
        assert any(c.generation.finish_reason != "abort" for p in partials for c in p.episode.calls)
        for partial in partials:
            i = int(partial.request_id[1])
            backend.start(partial.request_id, prompt(i), params(i), prefix=partial)

    straight, _ = asyncio.run(main(None))
    restarted, counts = asyncio.run(main(abort_and_restart))
    assert restarted == straight
    assert counts["replayed"] >= 1 and counts.get("replay_diverged", 0) == 0


@pytest.mark.parametrize(("kind", "reason"), [("raise", "agent_error: ValueError: the agent gave up"),
                                              ("hang", "agent_timeout"), ("silent", "agent_no_calls"),
                                              ("bad_request", "agent_error: BadRequestError"),
                                              ("no_reward", "agent_error: the agent returned no reward")])
def test_a_failing_agent_ends_only_its_episode_scored_zero_with_a_reason(word_model, chat_tokenizer, agents_file,
                                                                        kind, reason):
    async def main():
        # the deadline is the pool's: long enough for the other episode on a busy machine, short for the hang
        async with agent_backend(word_model, chat_tokenizer, f"{agents_file}:fail", lockstep=False,
                                 timeout_s=5.0 if kind == "hang" else 60.0) as (backend, _):
            result = await run_episodes(backend, [prompt(0, kind), prompt(1, "fine")])
            return result, backend.stats()
    result, stats = asyncio.run(main())
    (failed, failed_verdict), (fine, fine_verdict) = result["p0#0"], result["p1#0"]
    assert failed_verdict.reward == 0.0 and not failed_verdict.passed
    assert failed_verdict.reason.startswith(reason), failed_verdict.reason
    assert stats[f"episode/end/{reason.split(':')[0]}"] == 1
    assert fine_verdict.reward == 7.0 and len(fine.episode.calls) == 3  # the run goes on
    if kind == "silent":  # nothing sampled: its group is dropped as empty, nothing to train
        assert not failed.token_ids


def test_a_run_whose_every_agent_episode_fails_stops_saying_why(word_model, chat_tokenizer, agents_file, monkeypatch):
    """Rather than drop rollout after rollout forever (a bug in the agent, say)."""
    from flashreinforce.controller import episodes

    monkeypatch.setattr(episodes, "AGENT_FAILURES_IN_A_ROW", 4)

    async def main():
        async with agent_backend(word_model, chat_tokenizer, f"{agents_file}:fail", lockstep=False) as (backend, _):
            failing = r"the last \d+ agent episodes all failed, the last one with agent_error"
            with pytest.raises(RuntimeError, match=failing):
                await run_episodes(backend, [prompt(i, "raise") for i in range(6)])
                await backend.finished()  # the loop's next wait
    asyncio.run(main())


def test_calls_outside_any_episode_are_served_beside_the_runs_episodes_and_through_a_pause(word_model,
                                                                                        chat_tokenizer):
    """endpoint.serve: /v1 calls use the policy, wait out a pause like the run's requests, and train nothing."""
    import openai

    from flashreinforce.endpoint.server import EndpointServer

    async def main():
        tok = chat_tokenizer
        engine = Engine(copy.deepcopy(word_model), max_batch_size=8, max_context=CONTEXT,
                        eos_token_ids=tok.eos_token_id, pad_token_id=tok.pad_token_id, tokenizer=tok)
        endpoint = Endpoint(tok, None, model_name="tiny", max_context=CONTEXT, max_new_tokens=6)
        server = EndpointServer(endpoint, api_key="key")
        await server.start()
        backend = EpisodeBackend(LocalBackend(engine, None, NoVerifiers(), tok, overlap=True), TextEpisodes(tok),
                                 agents=AgentParts(endpoint, AgentPool({}), Settings(server.base_url, "key")))
        try:
            backend.start("p0#0", prompt(0), params(0))
            client = openai.AsyncOpenAI(base_url=server.base_url(), api_key="key", max_retries=0)
            calls = [asyncio.ensure_future(client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=6)) for i in range(4)]
            while endpoint.pending < 4:
                await asyncio.sleep(0.001)
            partials, _ = await backend.pause()
            assert backend.agents.calls.held, "no call was caught by the pause"
            await backend.resume(partials)
            ended = []

            async def loop_wait():  # the loop's wait on the backend, which also hands the calls their answers
                while True:
                    ended.extend(await backend.finished())
            waiting = asyncio.ensure_future(loop_wait())
            replies = await asyncio.gather(*calls)
            while not ended:
                await asyncio.sleep(0.01)
            waiting.cancel()
            return replies, ended, endpoint
        finally:
            await backend.close()
            await server.stop()
    replies, ended, endpoint = asyncio.run(main())
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in replies)
    assert [g.request_id for g in ended] == ["p0#0"] and endpoint.counts["calls"] == 4 and not endpoint.episodes

