"""LoRA adapter pushes into the local engine (rollout/adapters.py): the base once, then the adapter alone merged into
it; the engine's log-probs are the trainer's recompute; a push that did not reach the engine fails its probe."""

import asyncio
import copy
import sys
from pathlib import Path

import pytest
import torch

from flashreinforce.controller.local import LocalBackend
from flashreinforce.models.adapter_push import PROBE_LOGPROBS, adapter_only, is_adapter_push
from flashreinforce.models.logprobs import token_logprobs
from flashreinforce.models.numerics import Numerics
from flashreinforce.rollout.adapters import LOW_PRECISION_FLOOR, PROBE_FLOOR, WeightPushError
from flashreinforce.rollout.engine import Engine
from flashreinforce.trainer.lora import LoraSettings
from flashreinforce.types import SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
from test_lora import batch, lora_trainer, tiny

pytestmark = pytest.mark.lora


def engine_of(model: torch.nn.Module, **options) -> Engine:
    """An engine over a copy of `model`: build it before a LoRA trainer wraps `model` in place."""
    return Engine(copy.deepcopy(model), max_batch_size=4, max_context=64, eos_token_ids=1, **options)


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def generate(engine: Engine, count: int = 4):
    for i in range(count):
        engine.submit(f"g{engine.version}-{i}", [2 + i, 3, 4], SamplingParams(max_new_tokens=12, seed=i))
    done = []
    while engine.has_work:
        done += engine.step()
    return done


def assert_samples_the_trainers_log_probs(engine: Engine, trainer, atol: float = 1e-5) -> None:
    trainer.model.eval()
    for gen in generate(engine):
        ids = torch.tensor([gen.prompt_ids + gen.token_ids])
        with torch.no_grad():
            recomputed, _ = token_logprobs(trainer.model, ids, with_entropy=False)
        gap = (recomputed[0, len(gen.prompt_ids):] - torch.tensor(gen.behavior_logprobs)).abs().max()
        assert gap <= atol, (gen.request_id, float(gap))
    trainer.model.train()


def test_the_base_goes_once_then_the_adapter_alone_and_the_engine_holds_the_merged_weights():
    model = tiny()
    engine, trainer = engine_of(model), lora_trainer(model)
    trainer.step(batch(0))
    first = trainer.push_state(base=True)
    engine.load_weights(first, trainer.version)
    for step in range(1, 4):
        trainer.step(batch(step))
        push = trainer.push_state(base=False)
        assert is_adapter_push(push) and nbytes(push) < nbytes(first) / 4  # the base never travels again
        assert not set(push) & set(engine.model.state_dict())  # not one weight of the model: A, B, scale, probe
        engine.load_weights(push, trainer.version)
        assert engine.probe.last.error <= 1e-5 and engine.probe.last.tolerance == PROBE_FLOOR
        merged = trainer.weights()
        assert all(torch.equal(merged[k], v) for k, v in engine.model.state_dict().items())  # bit for bit
    assert_samples_the_trainers_log_probs(engine, trainer)
    assert engine.version == 4


def test_a_push_that_did_not_reach_the_engine_fails_the_probe():
    model = tiny()
    engine, trainer = engine_of(model), lora_trainer(model)
    trainer.step(batch(0))
    engine.load_weights(trainer.push_state(base=True), trainer.version)
    stale = {name: tensor.clone() for name, tensor in adapter_only(trainer.push_state()).items()}
    for step in range(1, 3):
        trainer.step(batch(step))
    # The adapter of two steps ago arrives labeled with today's probe: what a lost or misrouted push looks like.
    lost = {**stale, PROBE_LOGPROBS: trainer.push_state(base=False)[PROBE_LOGPROBS]}
    with pytest.raises(WeightPushError, match="did not take.*tolerance 0.0001"):
        engine.load_weights(lost, trainer.version)


def test_an_adapter_without_a_base_is_refused_and_a_full_push_forgets_the_base():
    model = tiny()
    engine = engine_of(model)  # as if built from a merged checkpoint: whatever it holds, it is no base it was given
    trainer = lora_trainer(model)
    trainer.step(batch(0))
    with pytest.raises(ValueError, match="holds none .* must be a base push"):
        engine.load_weights(trainer.push_state(base=False), trainer.version)
    engine.load_weights(trainer.push_state(base=True), trainer.version)
    engine.load_weights(trainer.weights(), trainer.version)  # merged weights: the kept base is stale now
    with pytest.raises(ValueError, match="holds none"):
        engine.load_weights(trainer.push_state(base=False), trainer.version)


def test_a_bf16_engine_takes_its_probe_tolerance_from_the_base_push_and_a_floor():
    model = tiny()
    unified = Numerics("bf16", unified=True)
    engine = engine_of(model, numerics=unified, probe_tolerance=None)
    with pytest.warns(UserWarning, match="unified"):
        trainer = lora_trainer(model, numerics=unified)
    trainer.step(batch(0))
    engine.load_weights(trainer.push_state(base=True), trainer.version)
    gap = engine.probe.last.error
    assert 0 < gap < 1e-2 and engine.probe.tolerance == max(LOW_PRECISION_FLOOR, 4 * gap)
    trainer.step(batch(1))
    engine.load_weights(trainer.push_state(base=False), trainer.version)
    assert engine.probe.last.tolerance == engine.probe.tolerance
    assert_samples_the_trainers_log_probs(engine, trainer, atol=0.1)  # rounding of the merged weights apart


def test_an_moe_engine_records_only_generation_routes_around_the_probe():
    moe = tiny(num_experts=4, experts_per_token=2)
    engine = engine_of(moe)
    with pytest.warns(UserWarning, match="routed-expert"):
        trainer = lora_trainer(moe)
    trainer.step(batch(0))
    engine.load_weights(trainer.push_state(base=True), trainer.version)  # the probe's forward is recorded too
    generations = generate(engine)  # a left-over capture would fail the next take()
    assert all(g.routes is not None for g in generations)
    assert_samples_the_trainers_log_probs(engine, trainer, atol=1e-4)


def test_the_local_backend_pushes_the_base_first_then_the_adapter_alone():
    model = tiny()
    engine, trainer = engine_of(model), lora_trainer(model)
    backend = LocalBackend(engine, trainer, pool=None, tokenizer=None, overlap=False)
    pushed = []
    load = engine.load_weights
    engine.load_weights = lambda state, version: (pushed.append(set(state)), load(state, version))
    for step in range(3):
        trainer.step(batch(step))
        assert asyncio.run(backend.push_weights()) == step + 1
    assert set(engine.model.state_dict()) < pushed[0]  # every weight, the base, once
    assert pushed[1] == pushed[2] and not pushed[1] & set(engine.model.state_dict())
    merged = trainer.weights()
    assert all(torch.equal(merged[k], v) for k, v in engine.model.state_dict().items())


def test_push_merged_sends_the_whole_merged_model_every_time():
    model = tiny()
    engine = engine_of(model)
    trainer = lora_trainer(model, lora=LoraSettings(r=4, alpha=8.0, push="merged"))
    trainer.step(batch(0))
    for base in (True, False):
        push = trainer.push_state(base=base)
        assert not is_adapter_push(push) and set(push) == set(engine.model.state_dict())
    engine.load_weights(trainer.push_state(base=False), trainer.version)
    merged = trainer.weights()
    assert all(torch.equal(merged[k], v) for k, v in engine.model.state_dict().items())
    with pytest.raises(ValueError, match="trainer.lora.push='both'"):
        LoraSettings(push="both")


def test_the_run_gives_vllm_a_lora_slot_and_the_local_engine_its_probe_tolerance_by_config():
    from flashreinforce.config import load_config
    from flashreinforce.run.engines import adapter_probe_tolerance, vllm_lora
    from flashreinforce.run.policy import Policy

    def config(*overrides):
        return load_config(None, ["trainer.lora={r: 4, alpha: 8}", *overrides])

    dense, moe = Policy(None, tiny()), Policy(None, tiny(num_experts=4, experts_per_token=2))
    assert vllm_lora(config(), dense) == 4
    assert vllm_lora(config("trainer.lora.push=merged"), dense) is None  # merged weights, loaded whole
    assert vllm_lora(config(), moe) is None  # vLLM's LoRA beside fused experts: untested, so merged
    assert vllm_lora(load_config(None, []), dense) is None
    assert adapter_probe_tolerance(config()) == PROBE_FLOOR
    assert adapter_probe_tolerance(config("precision.rollout=bf16")) is None
