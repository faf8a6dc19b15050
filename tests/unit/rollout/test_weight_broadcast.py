"""The weight group (rollout/weight_broadcast.py) over gloo: members are threads of this process, each with a
group of its own (as the Ray backend's trainer rank 0 and engine actors each hold one)."""

import datetime
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from flashreinforce.models import build_model
from flashreinforce.rollout import Engine
from flashreinforce.rollout.weight_broadcast import WeightGroup, WeightGroupSpec, finish, nccl_group
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
    results = _members(3, lambda rank, group: None, timeout_s=1.0, joining=[0, 1])
    assert time.monotonic() - started < 20
    assert all(isinstance(results[rank], Exception) for rank in (0, 1)), results


# ---- completion on the host (what NCCL's wait() does not give) -----------------------------------------------

class StuckWork:
    """A collective's Work as NCCL hands it out when a peer is gone: wait() returns at once (it only makes the
    current CUDA stream wait) and the work never completes."""

    def __init__(self):
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        return True

    def is_completed(self):
        return False


class StuckGroup:
    """A process group whose every broadcast is a StuckWork."""

    def __init__(self):
        self.works = []

    def broadcast(self, tensors, options):
        self.works.append(StuckWork())
        return self.works[-1]

    def abort(self):
        pass


def _stuck(timeout_s):
    """A WeightGroup over a StuckGroup (the NCCL path's host side, without a GPU)."""
    group = WeightGroup.__new__(WeightGroup)
    group.spec = WeightGroupSpec("tcp://127.0.0.1:1", 1, 2, "nccl", timeout_s)
    group.rank, group.device, group._group = 0, torch.device("cpu"), StuckGroup()
    return group


def test_a_push_whose_collective_never_completes_fails_on_the_host_within_the_timeout():
    """rank 0's send and an engine's receive raise within the group's timeout, so the trainer actor can leave the
    group and answer the driver (rank 0 never fails because of an engine), instead of counting a wait() that
    returned at once as a push done."""
    for side in ("send", "receive"):
        group = _stuck(timeout_s=0.3)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"did not complete within 0.3 s"):
            if side == "send":
                group.send({"w": torch.ones(3)}, version=1)
            else:
                group.receive()
        assert time.monotonic() - started < 3.0, side
        assert group._group.works[0].waits >= 1, "wait() returned, and did not count as done"


class Work:
    """A Work that completes at its `completes_at`-th check, ending with `error` (raised by wait() from then)."""

    def __init__(self, completes_at, error=None):
        self.completes_at, self.error, self.checks = completes_at, error, 0

    def wait(self, timeout=None):
        if self.error is not None and self.checks >= self.completes_at:
            raise self.error
        return True

    def is_completed(self):
        self.checks += 1
        return self.checks >= self.completes_at


def test_finish_waits_for_completion_and_raises_what_the_collective_ended_with():
    work = Work(completes_at=4)
    finish(work, timeout_s=5.0)
    assert work.checks == 4
    with pytest.raises(RuntimeError, match="watchdog caught collective operation timeout"):
        finish(Work(completes_at=2, error=RuntimeError("watchdog caught collective operation timeout")), 5.0)


def test_finish_gives_up_at_its_deadline_on_a_work_that_never_completes():
    now = [0.0]
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    with pytest.raises(TimeoutError, match="within 2 s"):
        finish(StuckWork(), 2.0, clock=lambda: now[0], sleep=sleep)
    assert 2.0 <= now[0] < 2.01 and max(slept) <= 0.005  # polled, never one long sleep past the deadline


def test_the_nccl_weight_group_is_built_with_the_watchdog_set_to_abort_only(monkeypatch):
    """TORCH_NCCL_ASYNC_ERROR_HANDLING is read as a ProcessGroupNCCL is built; the weight group's is built with 2
    (abort the communicator, keep the process), and the process's own setting is back after. A fake
    ProcessGroupNCCL: this torch may have none, and no GPU is needed to check what it is built with."""
    seen = {}

    class FakeNCCL:
        class Options:
            _timeout = None

        def __init__(self, store, rank, size, options):
            seen.update(handling=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), timeout=options._timeout)

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    nccl_group(None, 0, 2, datetime.timedelta(seconds=5))
    assert seen == {"handling": "2", "timeout": datetime.timedelta(seconds=10)}
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    nccl_group(None, 0, 2, datetime.timedelta(seconds=5))
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ


# ---- tied weights ------------------------------------------------------------------------------------------------

def test_a_tied_weight_is_sent_once_and_loads_into_an_engine_still_tied():
    """Tied input and output embeddings are one tensor under two names: it crosses the group once, comes out as
    one tensor under both names, and an engine loading it holds the trainer's weights, its own still tied."""
    weights = build_model(256, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=64,
                          seed=1).state_dict()
    assert weights["lm_head.weight"].data_ptr() == weights["model.embed_tokens.weight"].data_ptr()
    sent = []

    def work(rank, group):
        if rank == 0:
            inner = group._group

            class Counting:
                def broadcast(self, tensors, options):
                    sent.append(tensors[0].numel())
                    return inner.broadcast(tensors, options)

            group._group = Counting()
            return group.send(weights, version=3)
        return group.receive()

    version, got = _members(2, work)[1]
    once = sum(t.numel() * t.element_size() for name, t in weights.items() if name != "lm_head.weight")
    assert sum(sent[2:]) == once, "bytes sent after the header: the tied weight went twice"
    assert list(got) == list(weights) and got["lm_head.weight"] is got["model.embed_tokens.weight"]
    engine = Engine(build_model(256, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=64, seed=2),
                    max_batch_size=1, max_context=64)
    engine.load_weights(got, version)
    held = engine.model.state_dict()
    assert all(torch.equal(held[name], tensor) for name, tensor in weights.items())
    assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
