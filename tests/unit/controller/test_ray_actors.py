"""The Ray backend's actor classes (controller/ray_actors.py) as plain objects in this process, without Ray: what
an engine actor and a trainer rank actor answer."""

import asyncio
import pickle

import pytest
import torch

pytest.importorskip("ray")

from flashreinforce.controller.ray_actors import EngineActor, Submission, TrainerActor
from flashreinforce.models import build_model
from flashreinforce.rollout import Engine
from flashreinforce.types import SamplingParams

pytestmark = pytest.mark.ray

VOCAB = 16
LONG = SamplingParams(max_new_tokens=400, temperature=1.0, seed=0)
SHORT = SamplingParams(max_new_tokens=3, temperature=1.0, seed=0)


def tiny_engine(config, policy, shape):
    model = build_model(VOCAB, hidden_size=16, num_layers=1, num_heads=2, max_position_embeddings=512)
    return Engine(model, max_batch_size=2, max_context=512)


def test_a_reset_engine_actor_takes_a_request_it_held_again():
    """What the driver does after an engine was only unavailable for a moment: reset it, then send it the same
    request again. Without the reset the second copy meets the first ("already in flight") and the poll raises."""

    async def run():
        actor = EngineActor(torch.get_num_threads(), tiny_engine, None, None, None)
        try:
            await actor.submit([Submission("r0", (1, 2, 3), LONG, None)])
            await asyncio.sleep(0.05)  # decoding
            await actor.reset()
            await actor.submit([Submission("r0", (1, 2, 3), SHORT, None)])
            report = await actor.finished(30.0)
            while not report.generations:
                report = await actor.finished(30.0)
            return report.generations
        finally:
            actor.engine.close()

    (generation,) = asyncio.run(run())
    assert generation.request_id == "r0" and len(generation.token_ids) == SHORT.max_new_tokens


def test_a_trainer_rank_hands_out_a_tied_weight_once_and_an_engine_loads_it_tied():
    """The object store's push: rank 0's weights() holds a tied weight as one tensor under both names, so Ray's
    serialization (pickle's, by object) carries its bytes once; the engine that loads them is still tied."""
    model = build_model(256, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=64, seed=1)

    class Trainer:
        version = 1

        def weights(self):
            return model.state_dict()

    actor = TrainerActor(torch.get_num_threads(), lambda config, policy, group: Trainer(), None, None)
    actor.setup(None)
    payload = actor.weights()
    embedding = payload["model.embed_tokens.weight"]
    untied = {name: tensor for name, tensor in payload.items() if name != "lm_head.weight"}
    extra = len(pickle.dumps(payload, protocol=5)) - len(pickle.dumps(untied, protocol=5))
    assert extra < embedding.numel() * embedding.element_size() / 10, f"lm_head.weight added {extra} bytes"
    engine = Engine(build_model(256, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=64, seed=2),
                    max_batch_size=1, max_context=64)
    engine.load_weights(pickle.loads(pickle.dumps(payload, protocol=5)), 1)
    held = engine.model.state_dict()
    assert all(torch.equal(held[name], tensor) for name, tensor in model.state_dict().items())
    assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
