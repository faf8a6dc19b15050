import asyncio
from dataclasses import replace

import pytest
import torch

from flashreinforce.models import build_model
from flashreinforce.rollout import AsyncEngine, Engine
from flashreinforce.types import SamplingParams


def make_model(seed=0):
    model = build_model(16, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=512, seed=seed)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8)  # peaked distributions: other weights, other tokens
    return model


def params(i, max_new_tokens=12):
    return SamplingParams(max_new_tokens=max_new_tokens, seed=i)


def sync_reference(n, max_new_tokens=12):
    engine = Engine(make_model(), max_batch_size=3, max_context=512)
    for i in range(n):
        engine.submit(f"r{i}", [1 + i % 5, 2], params(i, max_new_tokens))
    out = {}
    while engine.has_work:
        out.update((g.request_id, g) for g in engine.step())
    return out


def with_engine(test):
    """Run `test(async_engine)` in a fresh event loop and always stop the driver thread."""

    async def main():
        engine = AsyncEngine(Engine(make_model(), max_batch_size=3, max_context=512))
        try:
            return await test(engine)
        finally:
            engine.close()

    return asyncio.run(main())


async def wait_for_tokens(engine, n):
    while engine.stats.sampled_tokens < n:
        await asyncio.sleep(0.001)


def test_concurrent_generate_calls_resolve_with_the_sync_engine_results():
    async def test(engine):
        return await asyncio.gather(*(engine.generate(f"r{i}", [1 + i % 5, 2], params(i)) for i in range(7)))

    results = with_engine(test)
    expected = sync_reference(7)
    assert [g.token_ids for g in results] == [expected[f"r{i}"].token_ids for i in range(7)]


def test_pause_load_resume_is_invisible_to_the_awaiting_callers_except_for_versions():
    budget = 300

    async def test(engine):
        tasks = [asyncio.create_task(engine.generate(f"r{i}", [1 + i, 2], params(i, budget))) for i in range(4)]
        await wait_for_tokens(engine, 10)
        partials = await engine.pause()
        assert {p.finish_reason for p in partials} == {"abort"} and len(partials) == 4
        assert not any(task.done() for task in tasks)
        await engine.load_weights(make_model(seed=1).state_dict(), version=1)
        await engine.resume()
        return partials, await asyncio.gather(*tasks)

    partials, results = with_engine(test)
    by_id = {p.request_id: p for p in partials}
    assert sum(len(p.token_ids) for p in partials) >= 10
    for g in results:
        before = len(by_id[g.request_id].token_ids)
        assert before < budget and len(g.token_ids) == budget and g.finish_reason == "length"
        assert g.token_ids[:before] == by_id[g.request_id].token_ids
        assert g.policy_versions == (0,) * before + (1,) * (budget - before)


def test_abort_resolves_the_awaiting_call_with_the_partial():
    async def test(engine):
        running = asyncio.create_task(engine.generate("long", [1, 2], params(0, 400)))
        await wait_for_tokens(engine, 5)
        partials = await engine.abort(["long", "unknown"])
        return partials, await running

    partials, result = with_engine(test)
    assert [p.request_id for p in partials] == ["long"]
    assert result == partials[0] and result.finish_reason == "abort" and 0 < len(result.token_ids) < 400


def test_paused_requests_can_be_aborted_or_resumed_selectively():
    async def test(engine):
        tasks = {i: asyncio.create_task(engine.generate(f"r{i}", [1, 2], params(i, 300))) for i in range(2)}
        await wait_for_tokens(engine, 4)
        partials = await engine.pause()
        with pytest.raises(ValueError, match="not paused"):
            await engine.resume([partials[0], replace(partials[0], request_id="stranger")])
        aborted = await engine.abort(["r1"])
        await engine.resume([p for p in partials if p.request_id == "r0"])
        return partials, aborted, await tasks[0], await tasks[1]

    partials, aborted, first, second = with_engine(test)
    assert second == aborted[0] == next(p for p in partials if p.request_id == "r1")
    assert first.finish_reason == "length" and len(first.token_ids) == 300


def test_cancelling_the_awaiting_task_aborts_the_request():
    async def test(engine):
        task = asyncio.create_task(engine.generate("c", [1, 2], params(0, 500)))
        await wait_for_tokens(engine, 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while engine.engine.has_work:  # read-only peek: the driver drops the request
            await asyncio.sleep(0.001)
        return engine.stats.sampled_tokens

    assert with_engine(test) < 500


def test_bad_input_raises_in_the_caller_and_close_fails_pending_calls():
    async def test(engine):
        with pytest.raises(ValueError, match="empty"):
            await engine.generate("bad", [], params(0))
        with pytest.raises(ValueError, match="already in flight"):
            first = asyncio.create_task(engine.generate("same", [1], params(0, 400)))
            await asyncio.sleep(0)
            await engine.generate("same", [1], params(0))
        await engine.pause()
        engine.close()
        with pytest.raises(RuntimeError, match="closed"):
            await first
        with pytest.raises(RuntimeError, match="closed"):
            await engine.generate("late", [1], params(0))

    with_engine(test)


def test_an_engine_failure_reaches_every_awaiting_caller():
    def broken_step():
        raise RuntimeError("boom")

    async def test(engine):
        engine.engine.step = broken_step  # set while the driver idles: nothing was submitted yet
        with pytest.raises(RuntimeError, match="boom"):
            await engine.generate("a", [1, 2], params(0))
        with pytest.raises(RuntimeError, match="stopped on an error"):
            await engine.generate("b", [1, 2], params(0))

    with_engine(test)
