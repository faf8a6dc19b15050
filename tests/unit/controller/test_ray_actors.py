"""The Ray backend's actor classes (controller/ray_actors.py) as plain objects in this process, without Ray: what
an engine actor and a trainer rank actor answer."""

import asyncio

import pytest
import torch

pytest.importorskip("ray")

from flashreinforce.controller.ray_actors import EngineActor, Submission  # noqa: E402
from flashreinforce.models import build_model  # noqa: E402
from flashreinforce.rollout import Engine  # noqa: E402
from flashreinforce.types import SamplingParams  # noqa: E402

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
