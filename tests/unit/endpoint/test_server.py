"""The endpoint over HTTP (aiohttp) with the real `openai` client and raw requests, on a tiny model in the embedded
engine: what it serves, and every bad input answered 4xx with an OpenAI error body while the engine goes on."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from flashreinforce.endpoint.chat import HERMES_TEMPLATE
from flashreinforce.endpoint.service import Endpoint, EngineCalls
from flashreinforce.types import SamplingParams

pytestmark = pytest.mark.endpoint

KEY = "test-key"
CONTEXT = 1024
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def engine(chat_tokenizer):
    from flashreinforce.models import build_model
    from flashreinforce.rollout.async_engine import AsyncEngine
    from flashreinforce.rollout.engine import Engine

    tok = chat_tokenizer
    model = build_model(len(tok), 32, 1, 2, CONTEXT, intermediate_size=64, pad_token_id=tok.pad_token_id,
                        eos_token_id=tok.eos_token_id)
    engine = AsyncEngine(Engine(model, max_batch_size=16, max_context=CONTEXT, eos_token_ids=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id, tokenizer=tok))
    yield engine
    engine.close()


@contextlib.asynccontextmanager
async def serving(engine, tokenizer, *, template=HERMES_TEMPLATE, max_pending=1024, max_new_tokens=8):
    from flashreinforce.endpoint.server import EndpointServer

    endpoint = Endpoint(tokenizer, EngineCalls(engine), model_name="tiny", max_context=CONTEXT,
                        max_new_tokens=max_new_tokens, chat_template=template, max_pending=max_pending)
    server = EndpointServer(endpoint, api_key=KEY)
    await server.start()
    try:
        yield endpoint, server
    finally:
        await server.stop()


def client(base_url: str, key: str = KEY):
    import openai

    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)


async def post(url: str, data: bytes, key: str = KEY, method: str = "POST") -> tuple[int, dict]:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.request(
            method, url, data=data, headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    ) as response:
        return response.status, await response.json()


def assert_openai_error(status: int, body: dict, expected: int, code: str | None = None) -> None:
    assert status == expected, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code


async def still_serves(server) -> None:
    """After a bad request: the endpoint and the engine answer a good one."""
    reply = await client(server.base_url()).chat.completions.create(
        model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_models_chat_with_tools_and_a_continued_episode(engine, chat_tokenizer):
    async def main():
        async with serving(engine, chat_tokenizer) as (endpoint, server):
            episode = endpoint.open_episode("p#0", SamplingParams(seed=1, max_new_tokens=8))
            agent = client(server.base_url(episode.id))
            assert [m.id for m in (await agent.models.list()).data] == ["tiny"]
            messages = [{"role": "user", "content": "What is 2+3?"}]
            first = await agent.chat.completions.create(model="gpt-x", messages=messages, tools=TOOLS, logprobs=True)
            record = episode.calls[0].generation
            assert [t.logprob for t in first.choices[0].logprobs.content] == list(record.behavior_logprobs)
            assert first.usage.completion_tokens == len(record.token_ids)
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": "c", "content": "5"}]
            await agent.chat.completions.create(model="gpt-x", messages=messages, tools=TOOLS)
            second = episode.calls[1].generation
            # the second call's prompt is the first call's row, sampled ids untouched, then the new messages
            assert second.prompt_ids[: len(record.prompt_ids) + len(record.token_ids)] == \
                (*record.prompt_ids, *record.token_ids)
    asyncio.run(main())


def test_streaming_gives_what_a_whole_response_gives(engine, chat_tokenizer):
    async def main():
        async with serving(engine, chat_tokenizer) as (_, server):
            api = client(server.base_url())
            ask = dict(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=6)
            whole = await api.chat.completions.create(**ask)
            stream = await api.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == whole.choices[0].message.content
            assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    asyncio.run(main())


def test_completions_take_token_ids_and_return_them_with_logprobs(engine, chat_tokenizer):
    async def main():
        async with serving(engine, chat_tokenizer) as (_, server):
            ids = chat_tokenizer.encode("The answer is", add_special_tokens=False)
            reply = await client(server.base_url()).completions.create(
                model="m", prompt=ids, max_tokens=4, logprobs=0, extra_body={"return_token_ids": True})
            body = reply.model_dump()
            assert body["prompt_token_ids"] == ids
            sampled = body["choices"][0]["token_ids"]
            assert len(reply.choices[0].logprobs.token_logprobs) == len(sampled) == reply.usage.completion_tokens
    asyncio.run(main())


def test_malformed_json_an_unknown_route_a_wrong_method_and_a_huge_body_are_4xx(engine, chat_tokenizer):
    async def main():
        async with serving(engine, chat_tokenizer) as (_, server):
            url = f"{server.base_url()}/chat/completions"
            assert_openai_error(*await post(url, b'{"messages": [}'), 400, "invalid_json")
            assert_openai_error(*await post(url, b'[1, 2]'), 400)
            assert_openai_error(*await post(f"{server.url}/v2/nothing", b"{}"), 404)
            assert_openai_error(*await post(url, b"", method="GET"), 405)
            huge = json.dumps({"messages": [{"role": "user", "content": "x" * (17 * 2**20)}]}).encode()
            assert_openai_error(*await post(url, huge), 413)
            await still_serves(server)
    asyncio.run(main())


def test_a_wrong_or_missing_api_key_is_a_401(engine, chat_tokenizer):
    import openai

    async def main():
        async with serving(engine, chat_tokenizer) as (_, server):
            with pytest.raises(openai.AuthenticationError) as refused:
                await client(server.base_url(), key="wrong").models.list()
            assert refused.value.code == "invalid_api_key"
            assert_openai_error(*await post(f"{server.base_url()}/models", b"", key="", method="GET"), 401)
            await still_serves(server)
    asyncio.run(main())


def test_an_unknown_episode_and_a_call_after_its_episode_ended(engine, chat_tokenizer):
    import openai

    async def main():
        async with serving(engine, chat_tokenizer) as (endpoint, server):
            with pytest.raises(openai.NotFoundError) as unknown:
                await client(server.base_url("ep99")).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}])
            assert unknown.value.code == "episode_not_found"
            episode = endpoint.open_episode("p#0", SamplingParams(seed=1, max_new_tokens=4))
            agent = client(server.base_url(episode.id))
            await agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            endpoint.close_episode(episode.id)
            with pytest.raises(openai.APIStatusError) as ended:
                await agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert ended.value.status_code == 410 and ended.value.code == "episode_ended"
            assert len(episode.calls) == 1, "the refused call must not be recorded"
            await still_serves(server)
    asyncio.run(main())


def test_a_prompt_over_the_context_is_a_400(engine, chat_tokenizer):
    import openai

    async def main():
        async with serving(engine, chat_tokenizer) as (_, server):
            with pytest.raises(openai.BadRequestError) as refused:
                await client(server.base_url()).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "Alla breve " * 600}])
            assert refused.value.code == "context_length_exceeded"
            await still_serves(server)
    asyncio.run(main())


def test_a_tool_schema_the_template_cannot_render_is_a_400(engine, chat_tokenizer):
    import openai

    async def main():
        async with serving(engine, chat_tokenizer, template=None) as (_, server):  # the test template: no tools
            with pytest.raises(openai.BadRequestError) as refused:
                await client(server.base_url()).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
            assert refused.value.code == "tools_not_supported"
            await still_serves(server)
        picky = ("{% if tools and tools[0].function.parameters is not defined %}{{ raise_exception('no schema') }}"
                 "{% endif %}")
        async with serving(engine, chat_tokenizer, template=picky + HERMES_TEMPLATE) as (_, server):
            with pytest.raises(openai.BadRequestError) as refused:
                await client(server.base_url()).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}],
                    tools=[{"type": "function", "function": {"name": "f"}}])
            assert refused.value.code == "template_error" and "no schema" in refused.value.message
            await still_serves(server)
    asyncio.run(main())


def test_a_thousand_concurrent_requests_are_each_answered_and_none_is_lost(engine, chat_tokenizer):
    import aiohttp

    async def main():
        async with serving(engine, chat_tokenizer, max_pending=200, max_new_tokens=1) as (endpoint, server):
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:
                async def one():
                    async with session.post(f"{server.base_url()}/chat/completions", data=body,
                                            headers={"Authorization": f"Bearer {KEY}"}) as response:
                        return response.status, await response.json()
                answers = await asyncio.gather(*(one() for _ in range(1000)))
            statuses = [status for status, _ in answers]
            assert set(statuses) <= {200, 429} and statuses.count(200) >= 200
            for status, reply in answers:
                if status == 429:
                    assert_openai_error(status, reply, 429, "rate_limit_exceeded")
                else:
                    assert reply["choices"][0]["finish_reason"] in ("stop", "length")
            assert endpoint.counts["calls"] == statuses.count(200) and endpoint.pending == 0
            await still_serves(server)
    asyncio.run(main())
