"""The engine records an MoE model's routes (R3): one (layers, top_k) entry per position, as the trainer's
full-sequence forward would choose them, kept through pause/resume and forced tokens."""

import copy

import numpy as np
import pytest
import torch

from flashreinforce.models import build_model
from flashreinforce.models.moe import RouteRecorder
from flashreinforce.rollout.engine import Engine, append_forced_tokens
from flashreinforce.trainer.checkpoint import load_states, save_checkpoint
from flashreinforce.types import SamplingParams


def _moe(seed: int = 0):
    model = build_model(40, 32, 2, 2, 96, eos_token_id=1, pad_token_id=0, num_experts=4, experts_per_token=2,
                        seed=seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.mul_(50.0)  # well-separated router probabilities: no float ties between paths
    return model


def _routes(generation) -> np.ndarray:
    r = generation.routes
    return np.frombuffer(r.data, dtype="<i2").reshape(r.positions, r.layers, r.top_k)


def _full_forward_routes(model, ids) -> np.ndarray:
    with torch.no_grad(), RouteRecorder(model) as recorder:
        model(input_ids=torch.tensor([ids]))
        return recorder.take().numpy()  # (T, layers, k)


def _run(engine, requests):
    for request_id, prompt, params in requests:
        engine.submit(request_id, prompt, params)
    finished = []
    while engine.has_work:
        finished += engine.step()
    return {g.request_id: g for g in finished}


def test_engine_routes_equal_the_full_forward_on_every_read_position():
    model = _moe()
    engine = Engine(copy.deepcopy(model), max_batch_size=8, max_context=90, eos_token_ids=1, prefill_threshold=8,
                    split_min_saving=0)
    generator = torch.Generator().manual_seed(0)
    # Prompts of 3 to 40 tokens: short ones read inline, long ones prefilled; lengths apart enough to split steps.
    requests = [(str(i), torch.randint(2, 40, (n,), generator=generator).tolist(),
                 SamplingParams(max_new_tokens=30, seed=i)) for i, n in enumerate([3, 5, 12, 40, 4, 33])]
    finished = _run(engine, requests)
    assert engine.stats.split_steps > 0
    for generation in finished.values():
        ids = [*generation.prompt_ids, *generation.token_ids]
        routes = _routes(generation)
        assert routes.shape == (len(ids), 2, 2)
        assert (routes[-1] == -1).all()  # the last token is never fed
        assert np.array_equal(routes[:-1], _full_forward_routes(model, ids)[:-1])


def test_dense_engine_has_no_routes():
    model = build_model(40, 32, 1, 2, 64, eos_token_id=1)
    engine = Engine(model, max_batch_size=2, max_context=40, eos_token_ids=1)
    finished = _run(engine, [("a", [3, 4], SamplingParams(max_new_tokens=5, seed=0))])
    assert finished["a"].routes is None


def test_routes_survive_pause_resume_and_forced_tokens():
    model = _moe(seed=1)
    engine = Engine(copy.deepcopy(model), max_batch_size=4, max_context=90, eos_token_ids=1)
    engine.submit("a", [5, 6, 7, 8], SamplingParams(max_new_tokens=60, seed=3))
    for _ in range(9):
        engine.step()
    (partial,) = engine.pause()
    assert partial.finish_reason == "abort" and _routes(partial).shape[0] == 4 + len(partial.token_ids)
    observed = append_forced_tokens(partial, [9, 10, 11])
    assert (_routes(observed)[-3:] == -1).all() and np.array_equal(_routes(observed)[:-3], _routes(partial))
    engine.submit("a", [5, 6, 7, 8], SamplingParams(max_new_tokens=60, seed=3), prefix=observed)
    finished = {}
    while engine.has_work:
        finished.update({g.request_id: g for g in engine.step()})
    generation = finished["a"]
    ids = [*generation.prompt_ids, *generation.token_ids]
    assert np.array_equal(_routes(generation)[:-1], _full_forward_routes(model, ids)[:-1])


def test_prefix_routes_of_another_shape_are_refused():
    model = _moe()
    engine = Engine(copy.deepcopy(model), max_batch_size=2, max_context=60, eos_token_ids=1)
    other = Engine(build_model(40, 32, 1, 2, 96, eos_token_id=1, num_experts=4, experts_per_token=1),
                   max_batch_size=2, max_context=60, eos_token_ids=1)
    other.submit("a", [3, 4], SamplingParams(max_new_tokens=20, seed=0))
    other.step()
    (partial,) = other.pause()
    with pytest.raises(ValueError, match="prefix.routes"):
        engine.submit("a", [3, 4], SamplingParams(max_new_tokens=20, seed=0), prefix=partial)


def test_routes_of_a_checkpointed_partial_continue_after_a_restart(tmp_path):
    """A partial written into a checkpoint (as a run's in-flight work is) comes back with its routes, and a
    new engine continues it with routes equal to a full forward's."""
    model = _moe(seed=2)
    engine = Engine(copy.deepcopy(model), max_batch_size=2, max_context=90, eos_token_ids=1)
    params = SamplingParams(max_new_tokens=50, seed=4)
    engine.submit("a", [5, 6, 7], params)
    for _ in range(8):
        engine.step()
    (partial,) = engine.pause()
    checkpoint = save_checkpoint(tmp_path, 1, write_model=lambda path: model.save_pretrained(path),
                                 trainer_state={}, controller_state={"inflight": [("a", partial)]}, meta={}, keep=1)
    _, controller_state, _ = load_states(checkpoint)
    (_, restored), = controller_state["inflight"]
    assert restored.routes == partial.routes and restored.routes is not None
    fresh = Engine(copy.deepcopy(model), max_batch_size=2, max_context=90, eos_token_ids=1)
    fresh.submit("a", [5, 6, 7], params, prefix=restored)
    done = {}
    while fresh.has_work:
        done.update({g.request_id: g for g in fresh.step()})
    generation = done["a"]
    ids = [*generation.prompt_ids, *generation.token_ids]
    assert len(generation.token_ids) > len(partial.token_ids)
    assert np.array_equal(_routes(generation)[:-1], _full_forward_routes(model, ids)[:-1])
