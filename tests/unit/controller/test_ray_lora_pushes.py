"""The Ray backend with a LoRA trainer: engine actors get the base once and then the adapter alone, through the
object store and through the weight group; an engine that restarts loads a push with the base; every engine then
holds rank 0's merged weights bit for bit."""

import asyncio
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from flashreinforce.config import load_config  # noqa: E402
from flashreinforce.controller.ray_backend import _FROM_TRAINER, start_ray_backend  # noqa: E402
from flashreinforce.controller.ray_cluster import resolve_devices  # noqa: E402
from flashreinforce.models.adapter_push import is_adapter_push  # noqa: E402
from flashreinforce.run.backends import ray_settings  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_ray_backend import (  # noqa: E402
    SMALL,
    Setup,
    _assert_engines_hold_rank_0s_weights,
    _train_moving,
    drain,
    submit,
    until_healthy,
)

pytestmark = [pytest.mark.ray, pytest.mark.lora, pytest.mark.slow]  # real Ray actors: each backend starts in ~15 s

LORA = "trainer.lora={r: 4, alpha: 8}"


@pytest.fixture(scope="module")
def setup(local_ray):
    return Setup(LORA)


def _sizes(backend) -> tuple[int, int]:
    """Bytes of rank 0's push with the base and without."""
    with_base, alone = (ray.get(backend.trainer.push_ref(base)) for base in (True, False))
    assert is_adapter_push(alone) and set(alone) < set(with_base)
    return (sum(t.numel() * t.element_size() for t in push.values()) for push in (with_base, alone))


def test_object_store_pushes_carry_the_adapter_alone_and_a_restarted_engine_gets_the_base(setup, loop):
    assert setup.settings.adapter_pushes
    backend = start_ray_backend(setup.settings, setup.parts)
    try:
        for step in (1, 2):
            _train_moving(backend, setup, loop, f"o{step}")
            assert loop.run_until_complete(backend.push_weights()) == step
            _assert_engines_hold_rank_0s_weights(backend)  # merged from the adapter by each engine
        assert backend._weights[1] is _FROM_TRAINER  # the second push was the adapter alone
        with_base, alone = _sizes(backend)
        assert alone < with_base / 4
        ids = [f"k{i}" for i in range(16)]

        async def run():
            submit(backend, setup, ids)
            await asyncio.sleep(0)
            ray.kill(backend.engines[0].actor, no_restart=False)  # rebuilt from the starting policy: no base
            got = await drain(backend, ids)
            await until_healthy(backend)
            return got

        got = loop.run_until_complete(run())
        assert sorted(got) == sorted(ids) and backend.counts["engine_restarts"] == 1
        _assert_engines_hold_rank_0s_weights(backend)  # it loaded rank 0's push with the base, then merged
        _train_moving(backend, setup, loop, "o3")
        assert loop.run_until_complete(backend.push_weights()) == 3  # the adapter alone reaches it too
        _assert_engines_hold_rank_0s_weights(backend)
    finally:
        loop.run_until_complete(backend.close())


def test_the_weight_group_broadcasts_the_base_once_a_generation_then_the_adapter(setup, loop):
    settings = resolve_devices(ray_settings(load_config(None, [*SMALL, LORA, "backend.weight_sync=broadcast"])),
                               ray.cluster_resources())
    backend = start_ray_backend(settings, setup.parts)
    try:
        for step in (1, 2):
            _train_moving(backend, setup, loop, f"b{step}")
            assert loop.run_until_complete(backend.push_weights()) == step
            assert backend._broadcaster.base_sent and backend._broadcaster.generation == 1
            _assert_engines_hold_rank_0s_weights(backend)
        assert backend.counts["weight_broadcasts"] == 2 and backend.counts["weight_broadcast_fallbacks"] == 0
    finally:
        loop.run_until_complete(backend.close())
