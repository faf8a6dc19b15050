"""The weight group (rollout/weight_broadcast.py) over gloo: members are threads of this process, each with a
group of its own (as the Ray backend's trainer rank 0 and engine actors each hold one)."""

import threading
import time

import torch

from flashreinforce.rollout.weight_broadcast import WeightGroup, WeightGroupSpec
from flashreinforce.trainer.distributed import launcher_store


def _members(world_size, work, generation=1, timeout_s=20.0, joining=None):
    """Run work(rank, group) in one thread per joining rank; {rank: result or the exception it raised}."""
    store, address = launcher_store()
    spec = WeightGroupSpec(address, generation, world_size, "gloo", timeout_s)
    results = {}

    def member(rank):
        try:
            group = WeightGroup(spec, rank)
            try:
                results[rank] = work(rank, group)
            finally:
                group.close()
        except Exception as error:  # noqa: BLE001 - the test reads it
            results[rank] = error

    threads = [threading.Thread(target=member, args=(rank,)) for rank in (joining or range(world_size))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout_s + 30)
    del store
    return results


def test_every_member_receives_rank_0s_weights_bit_for_bit_with_the_version():
    generator = torch.Generator().manual_seed(0)
    weights = {"embed.weight": torch.randn(7, 5, generator=generator),
               "layer.weight": torch.randn(3, 4, generator=generator).to(torch.bfloat16),
               "layer.scale": torch.randn(3, generator=generator).to(torch.float8_e4m3fn),
               "layer.bias": torch.randn(3, generator=generator).half(),
               "step": torch.tensor(11, dtype=torch.int64),
               "mask": torch.tensor([True, False, True]),
               "empty": torch.zeros(0, 4)}

    def work(rank, group):
        if rank == 0:
            return group.send(weights, version=42)
        return group.receive()

    results = _members(3, work)
    for rank in (1, 2):
        version, got = results[rank]
        assert version == 42
        assert list(got) == list(weights)  # the sender's order
        for name, tensor in weights.items():
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
            bits = [t.reshape(-1).view(torch.uint8) for t in (got[name], tensor)]  # fp8 has no torch.equal
            assert torch.equal(*bits), name


def test_two_pushes_in_a_row_arrive_in_order():
    def work(rank, group):
        if rank == 0:
            group.send({"w": torch.full((4,), 1.0)}, version=1)
            group.send({"w": torch.full((4,), 2.0)}, version=2)
            return None
        return [group.receive(), group.receive()]

    (first, second) = _members(2, work)[1]
    assert first[0] == 1 and torch.equal(first[1]["w"], torch.full((4,), 1.0))
    assert second[0] == 2 and torch.equal(second[1]["w"], torch.full((4,), 2.0))


def test_a_member_that_never_joins_fails_the_others_within_the_timeout():
    started = time.monotonic()
    results = _members(3, lambda rank, group: None, timeout_s=2.0, joining=[0, 1])
    assert time.monotonic() - started < 20
    assert all(isinstance(results[rank], Exception) for rank in (0, 1)), results
