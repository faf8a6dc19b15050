"""Data-parallel ranks (trainer/distributed.py, trainer/group.py): 2 gloo ranks give the one-process step."""

import functools
import math
import os
import signal
import time

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from flashreinforce.models import build_model
from flashreinforce.models.logprobs import token_logprobs
from flashreinforce.models.numerics import Numerics, format_state, fp8_parameter_names
from flashreinforce.trainer.distributed import RankGroup, Shard, join_group
from flashreinforce.trainer.group import TrainerGroup, TrainerRankError
from flashreinforce.trainer.lora import LoraSettings
from flashreinforce.trainer.trainer import OptimizerSettings, Trainer
from flashreinforce.types import FORCED_VERSION, Prompt, RolloutKey, Trajectory, Verdict

VOCAB = 13


def model(num_experts: int = 0) -> torch.nn.Module:
    return build_model(VOCAB, 16, 2, 2, 48, seed=5, num_experts=num_experts)


def trainer(net: torch.nn.Module, grads_to: str | None = None, rank: int = 0, sharding: str = "replicate",
            precision: str | Numerics = "fp32", lora: bool = False, minibatches: int = 1, pack: bool = False) -> Trainer:
    """fp32, no clipping (so the recorded gradient is the raw sum), two-row microbatches, the entropy filter on;
    `lora`: rank-4 adapters on every attention and MLP projection (B starts at 0, so A's first gradient is 0).
    With `grads_to`, every optimizer step first saves the gradient it steps with to grads_to/rank<r>.pt (a
    sharded rank's gathered in full), and after it the weights to grads_to/weights<r>.pt (a sharded group's
    on rank 0 only)."""
    built = Trainer(
        net, loss="flashreinforce", loss_options={"negative_token_fraction": 0.5},
        optimizer=OptimizerSettings(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=0, total_steps=10,
                                    min_lr_ratio=1.0, grad_clip=math.inf),
        microbatch_size=2, pad_token_id=0, temperature=1.0, max_new_tokens=16, sharding=sharding,
        numerics=precision if isinstance(precision, Numerics) else Numerics(precision),
        lora=LoraSettings(r=4, alpha=8.0, seed=3) if lora else None, minibatches=minibatches, pack=pack)
    if grads_to is not None:
        path = os.path.join(grads_to, f"rank{rank}.pt")
        built.optimizer.register_step_pre_hook(
            lambda *_: torch.save([full(p.grad).clone() for p in built.masters.params], path))
        built.optimizer.register_step_post_hook(
            lambda *_: torch.save(built.weights(), os.path.join(grads_to, f"weights{rank}.pt")))
    return built


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def rank_trainer(net: torch.nn.Module, grads_to: str, sharding: str, precision: str | Numerics, group: RankGroup,
                 lora: bool = False, minibatches: int = 1, pack: bool = False) -> Trainer:
    """The factory each rank's process runs (module level: importable there by name)."""
    torch.set_num_threads(1)
    join_group(group)
    return trainer(net, grads_to, group.rank, sharding, precision, lora, minibatches, pack)


def failing_rank_trainer(net: torch.nn.Module, grads_to: str, sharding: str, precision: str,
                         group: RankGroup) -> Trainer:
    """rank_trainer, except that rank 1 fails before it joins the group."""
    if group.rank == 1:
        raise ValueError("rank 1 cannot build its trainer")
    return rank_trainer(net, grads_to, sharding, precision, group)


def batch(rows: int = 7, seed: int = 0, num_experts: int = 0) -> list[Trajectory]:
    """Rows of different lengths (so the ranks' shares differ), half failed, one group per row; behavior
    log-probs are the initial model's own, so the trust region passes every row and the gradient is not 0."""
    g = torch.Generator().manual_seed(seed)
    sampler = model(num_experts)
    out = []
    for i in range(rows):
        n = 4 + int(torch.randint(0, 12, (1,), generator=g))
        tokens = torch.randint(1, VOCAB, (1, n), generator=g)
        mask = tuple(int(j >= 3) for j in range(n))
        with torch.no_grad():
            logprobs, _ = token_logprobs(sampler, tokens, with_entropy=False)
        reward = float(i % 2)
        out.append(Trajectory(
            key=RolloutKey(f"p{i}", 0), prompt=Prompt(id=f"p{i}", prompt="x", ground_truth="1"), group=i,
            tokens=tuple(tokens[0].tolist()), loss_mask=mask,
            behavior_logprobs=tuple(float(lp) * m for lp, m in zip(logprobs[0], mask)),
            policy_versions=tuple(0 if m else FORCED_VERSION for m in mask), prompt_length=3,
            finish_reason="stop", verdict=Verdict(reward=reward, passed=reward > 0)))
    return out


def group(tmp_path, world_size: int = 2, sharding: str = "replicate", precision: str | Numerics = "fp32",
          net: torch.nn.Module | None = None, lora: bool = False, minibatches: int = 1,
          pack: bool = False) -> TrainerGroup:
    net = net or model()
    factory = functools.partial(rank_trainer, lora=lora, minibatches=minibatches, pack=pack)
    return TrainerGroup(factory, (net, str(tmp_path), sharding, precision), world_size=world_size,
                        backend="gloo", threads=1, sharded=sharding == "fsdp")


def one_process_step(tmp_path, net: torch.nn.Module, rows: list[Trajectory], **options) -> tuple[Trainer, dict, list]:
    """One process's trainer after a step on `rows`: (trainer, its metrics, the gradient it stepped with)."""
    (tmp_path / "single").mkdir()
    single = trainer(net, str(tmp_path / "single"), **options)
    metrics = single.step(rows)
    return single, metrics, torch.load(tmp_path / "single" / "rank0.pt")


def assert_each_rank_stepped_with(reference: list[torch.Tensor], grads_dir, world_size: int = 2) -> None:
    """Every rank's recorded gradient (a sharded rank's gathered in full) is `reference`, to 1e-6."""
    for rank in range(world_size):
        for mine, theirs in zip(torch.load(grads_dir / f"rank{rank}.pt"), reference, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


def test_the_ranks_share_out_every_row_once():
    shares = [Shard(rank, 3).rows(8).tolist() for rank in range(3)]
    assert shares == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert Shard().rows(4).tolist() == [0, 1, 2, 3]
    # more ranks than rows: the ranks past the last row train nothing (they still join every collective)
    assert [Shard(rank, 8).rows(4).tolist() for rank in range(8)] == [[0], [1], [2], [3], [], [], [], []]


# 3 ranks, 2 rows: rank 2 trains nothing and still takes part in the sum (sharded: in every gather and
# reduce-scatter of its peers' microbatches)
# an MoE model (4 experts, top-2): the experts a rank's tokens do not pick still get their (zero) gradient shards.
# Slow: rank processes of their own (~8 s each on 2 cores); test_trainer.py checks microbatches in one process.
@pytest.mark.parametrize(("world_size", "rows", "sharding", "experts"), [
    pytest.param(2, 7, "replicate", 0, marks=pytest.mark.slow), pytest.param(2, 7, "fsdp", 0, marks=pytest.mark.slow),
    pytest.param(2, 7, "fsdp", 4, marks=pytest.mark.slow),
    pytest.param(3, 2, "replicate", 0, marks=pytest.mark.slow), pytest.param(3, 2, "fsdp", 0, marks=pytest.mark.slow)])
def test_gloo_ranks_give_the_one_process_gradient_and_step(tmp_path, one_thread, world_size, rows, sharding, experts):
    single, expected, reference = one_process_step(tmp_path, model(experts), batch(rows, num_experts=experts))
    assert expected["optim/grad_norm"] > 1e-3 and expected["mismatch/gate_rejected_fraction"] == 0
    ranks = group(tmp_path, world_size, sharding, net=model(experts))
    try:
        got = ranks.step(batch(rows, num_experts=experts))
        assert_each_rank_stepped_with(reference, tmp_path, world_size)
        assert got.keys() == expected.keys()
        for name in ("loss/policy", "optim/grad_norm", "entropy/mean", "mismatch/seq_kl_p50", "batch/rows",
                     "batch/policy_tokens", "mismatch/abs_logprob_diff"):
            assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name
        assert ranks.version == single.version == 1
        # AdamW's first step moves each weight by about lr * sign(grad), so a gradient of ~1e-9 that differs
        # in its last bits moves its weight by up to ~lr * 1e-3: the weights agree to 1e-5, the gradients to 1e-6.
        for name, tensor in single.weights().items():
            torch.testing.assert_close(ranks.weights()[name], tensor, rtol=0, atol=1e-5)
    finally:
        ranks.close()


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
def test_minibatches_on_gloo_ranks_step_as_one_process(tmp_path, one_thread, sharding):
    """trainer.minibatches=2 on 2 ranks: each part's rows shared out, theta_old's pass and every step collective;
    the last step's gradient and the weights after both are the one process's."""
    single, expected, reference = one_process_step(tmp_path, model(), batch(7), minibatches=2)
    assert expected["optim/minibatches"] == 2
    ranks = group(tmp_path, 2, sharding, minibatches=2)
    try:
        got = ranks.step(batch(7))
        assert_each_rank_stepped_with(reference, tmp_path)
        for name in ("loss/policy", "optim/grad_norm", "entropy/mean", "batch/policy_tokens"):
            assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name
        for name, tensor in single.weights().items():
            torch.testing.assert_close(ranks.weights()[name], tensor, rtol=0, atol=1e-5)
    finally:
        ranks.close()


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
def test_packed_ranks_step_as_one_padded_process(tmp_path, one_thread, sharding):
    """trainer.pack on 2 ranks: each rank packs its own share of the rows (sharded: the rank with fewer microbatches
    runs idle passes, as padded), and the gradient and weights are the one padded process's."""
    single, expected, reference = one_process_step(tmp_path, model(), batch(9))
    ranks = group(tmp_path, 2, sharding, pack=True)
    try:
        got = ranks.step(batch(9))
        assert_each_rank_stepped_with(reference, tmp_path)
        for name in ("loss/policy", "optim/grad_norm", "entropy/mean", "batch/policy_tokens"):
            assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name
        assert got["batch/padding_fraction"] < expected["batch/padding_fraction"]
        for name, tensor in single.weights().items():
            torch.testing.assert_close(ranks.weights()[name], tensor, rtol=0, atol=1e-5)
    finally:
        ranks.close()


@pytest.mark.slow
def test_both_ranks_hold_the_same_weights_after_steps(tmp_path, one_thread):
    ranks = group(tmp_path)
    try:
        for step in range(3):
            ranks.step(batch(5, seed=step))
        weights = [torch.load(tmp_path / f"weights{rank}.pt") for rank in (0, 1)]  # each rank's own, after step 3
        assert weights[0].keys() == weights[1].keys()
        for name, tensor in weights[0].items():
            assert torch.equal(tensor, weights[1][name]), name
        assert ranks.weights().keys() == weights[0].keys()  # rank 0 publishes the group's weights
        with pytest.raises(RuntimeError, match="publishes no weights"):
            ranks.ranks[1].weights()  # the others publish none: nobody reads them
        state = ranks.state_dict()
        assert state["version"] == 3
    finally:
        ranks.close()


@pytest.mark.slow
def test_a_killed_rank_fails_the_step_loudly(tmp_path, one_thread):
    ranks = group(tmp_path)
    try:
        ranks.step(batch(4))
        os.kill(ranks.ranks[1]._proc.pid, signal.SIGKILL)
        with pytest.raises(TrainerRankError, match=r"rank 1 of 2 failed during 'step'.*flashreinforce train --resume"):
            ranks.step(batch(4))
    finally:
        ranks.close()


@pytest.mark.slow
def test_a_rank_that_fails_to_start_fails_the_group_at_once_naming_it(tmp_path, one_thread):
    """Rank 0 would wait in join_group for the failed rank until its 300 s timeout: the group stops it."""
    started = time.monotonic()
    with pytest.raises(TrainerRankError, match=r"rank 1 \(first\): ValueError: rank 1 cannot build its trainer"):
        TrainerGroup(failing_rank_trainer, (model(), str(tmp_path), "replicate", "fp32"), world_size=2, backend="gloo",
                     threads=1)
    assert time.monotonic() - started < 120


# unified fp8: the base is formatted whole (tensor scales) before it is sharded, and computes in fp32
@pytest.mark.lora
@pytest.mark.filterwarnings("ignore:trainer.lora with precision.mode=unified")
@pytest.mark.slow  # two rank processes with peft (~8 s)
@pytest.mark.parametrize("precision", ["fp32", Numerics("fp8", unified=True, fp8_scaling="tensor")],
                         ids=["fp32", "fp8-unified"])
def test_sharded_lora_ranks_give_the_one_process_adapter_gradient_and_merged_weights(tmp_path, one_thread,
                                                                                     precision):
    """FSDP over a LoRA model (its frozen base sharded too): the adapters' gradient is the one-process one,
    and the merged weights the ranks publish are the unsharded LoRA trainer's, under the base names."""
    single, expected, reference = one_process_step(tmp_path, model(), batch(), lora=True, precision=precision)
    assert len(reference) == 2 * 2 * 7  # A and B of 7 projections in each of 2 layers: only adapters train
    assert expected["optim/grad_norm"] > 1e-3
    ranks = group(tmp_path, sharding="fsdp", lora=True, precision=precision)
    try:
        got = ranks.step(batch())
        assert_each_rank_stepped_with(reference, tmp_path)
        assert got["loss/policy"] == pytest.approx(expected["loss/policy"], rel=1e-5)
        merged, own = ranks.weights(), single.weights()
        assert merged.keys() == own.keys() == model().state_dict().keys()
        for name, tensor in own.items():
            torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-5)
        assert any(not torch.equal(own[n], t) for n, t in model().state_dict().items())  # the step moved them
    finally:
        ranks.close()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft reads a deprecated attribute
# fp32 full, bf16 LoRA and fp8 full (its masters sharded beside the formatted weights) in CI; the other two
# combinations are marked long for CI's time
@pytest.mark.parametrize(("precision", "lora"), [("fp32", False), pytest.param("bf16", False, marks=pytest.mark.long),
                                                 pytest.param("fp32", True, marks=[pytest.mark.long, pytest.mark.lora]),
                                                 pytest.param("bf16", True, marks=pytest.mark.lora), ("fp8", False)])
def test_a_sharded_group_saves_a_loadable_model_and_resumes_its_exact_step(tmp_path, one_thread, precision, lora):
    """A checkpoint of an FSDP group (the model saved by rank 0, the optimizer state and bf16's or fp8's fp32
    masters gathered in full) resumes into a new group whose next step is the uninterrupted group's."""
    (tmp_path / "steady").mkdir()
    (tmp_path / "resumed").mkdir()
    steady = group(tmp_path / "steady", sharding="fsdp", precision=precision, lora=lora)
    try:
        steady.step(batch(5, seed=0))
        state = steady.state_dict()
        steady.save_model(tmp_path / "model")
        expected = steady.step(batch(6, seed=1))
        expected_weights = {name: tensor.clone() for name, tensor in steady.weights().items()}
    finally:
        steady.close()
    assert state["sharding"] == "fsdp" and state["version"] == 1
    assert ("master_weights" in state) == (precision != "fp32" and not lora)  # adapters step as they are
    assert ("lora" in state) == lora
    if lora:  # the adapter alone, in peft's format, loads onto the base model
        peft = pytest.importorskip("peft")
        adapted = peft.PeftModel.from_pretrained(model(), tmp_path / "model" / "adapter")
        assert sum("lora_B" in n and p.abs().sum() > 0 for n, p in adapted.named_parameters()) == 14
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert type(saved).__name__ == "Qwen2ForCausalLM"
    assert saved.config.architectures == ["Qwen2ForCausalLM"]
    assert saved.dtype == (torch.float32 if precision == "fp32" else torch.bfloat16)
    resumed = group(tmp_path / "resumed", sharding="fsdp", precision=precision, net=saved.float(), lora=lora)
    try:
        resumed.load_state_dict(state)
        got = resumed.step(batch(6, seed=1))
        assert resumed.version == 2
        assert got["loss/policy"] == pytest.approx(expected["loss/policy"], rel=1e-6)
        for name, tensor in expected_weights.items():
            torch.testing.assert_close(resumed.weights()[name], tensor, rtol=0, atol=0)
    finally:
        resumed.close()


def test_a_checkpoint_resumes_only_with_the_sharding_that_wrote_it():
    state = trainer(model()).state_dict()
    with pytest.raises(ValueError, match="written with sharding fsdp but this trainer is replicate"):
        trainer(model()).load_state_dict({**state, "sharding": "fsdp"})


def outlier_model(num_experts: int = 0) -> torch.nn.Module:
    """model() with the second half of every matrix's rows (of a stacked expert tensor: of its experts) 1024x
    smaller. Power-of-two scales change only which values fall below e4m3's normal range (2^-6 x scale), so a
    scale matters where a tensor spans more than ~2^9: here each matrix's fp8 tensor scale is set by the rows
    rank 0 holds, under which most of rank 1's rows are subnormal, and the rows of rank 1 alone would give a
    scale that keeps them normal."""
    net = model(num_experts)
    with torch.no_grad():
        for param in net.parameters():
            if param.ndim >= 2:
                param[param.shape[0] // 2:] /= 1024
    return net


# fp8 and unified: the shards hold the formatted weights and fp32 master shards sit beside them
# (trainer/sharding.py::ShardedMasters). A matrix's tensor scale spans both ranks' rows (its master is gathered
# to format it); channel scales are each rank's own. Unified computes in fp32, so the step is the one-process step.
# 3 ranks: the 16-row matrices shard unevenly (6, 6, 4 rows). 4 experts: each rank holds 2 whole (E, out, in)
# expert matrices and scales them itself.
@pytest.mark.parametrize(("numerics", "world_size", "experts"), [
    pytest.param(Numerics("fp8", unified=True, fp8_scaling="tensor"), 2, 0, marks=pytest.mark.slow),
    pytest.param(Numerics("fp8", unified=True, fp8_scaling="tensor"), 3, 0, marks=pytest.mark.slow),
    pytest.param(Numerics("fp8", unified=True, fp8_scaling="tensor"), 2, 4, marks=pytest.mark.slow),
    pytest.param(Numerics("fp8", unified=True, fp8_scaling="channel"), 2, 0, marks=pytest.mark.slow),
    pytest.param(Numerics("bf16", unified=True), 2, 0, marks=pytest.mark.slow)],
    ids=["fp8-tensor", "fp8-tensor-3-ranks", "fp8-tensor-moe", "fp8-channel", "bf16"])
def test_sharded_unified_ranks_give_the_one_process_step(tmp_path, one_thread, numerics, world_size, experts):
    rows = batch(num_experts=experts)
    single, expected, reference = one_process_step(tmp_path, outlier_model(experts), rows, precision=numerics)
    ranks = group(tmp_path, world_size, sharding="fsdp", precision=numerics, net=outlier_model(experts))
    try:
        got = ranks.step(rows)
        assert_each_rank_stepped_with(reference, tmp_path, world_size)
        assert got["loss/policy"] == pytest.approx(expected["loss/policy"], rel=1e-5)
        masters = ranks.state_dict()["master_weights"]
        for name, master in single.masters.state_dict().items():
            torch.testing.assert_close(masters[name], master, rtol=0, atol=1e-5)
        # what the ranks publish is the whole masters formatted, bit for bit: a scale taken over one rank's
        # rows alone would differ
        published = ranks.weights()
        formatted = format_state(masters, numerics, fp8_parameter_names(outlier_model(experts)))
        assert published.keys() == formatted.keys() == model(experts).state_dict().keys()
        for name, tensor in formatted.items():
            assert published[name].dtype == torch.float32 and torch.equal(published[name], tensor), name
    finally:
        ranks.close()


@pytest.mark.slow
def test_sharded_fp8_ranks_step_as_replicated_ones(tmp_path, one_thread):
    """Separate-mode fp8 computes in bf16, so each rank's share of the batch is what it is in a replicated
    group (its rows, microbatches and weights). The gradients differ in how bf16 sums round: a replicated rank
    accumulates its microbatches in bf16 and the ranks are summed in fp32; FSDP sums the ranks of each
    microbatch in fp32 and accumulates the bf16 result. Measured: within 0.44% of each tensor's norm."""
    numerics = Numerics("fp8", fp8_scaling="block", fp8_block=4)
    for name in ("replicate", "fsdp"):
        (tmp_path / name).mkdir()
        ranks = group(tmp_path / name, sharding=name, precision=numerics)
        try:
            ranks.step(batch())
        finally:
            ranks.close()
    for rank in range(2):
        for mine, theirs in zip(torch.load(tmp_path / "fsdp" / f"rank{rank}.pt"),
                                torch.load(tmp_path / "replicate" / f"rank{rank}.pt"), strict=True):
            assert (mine - theirs).norm() <= 2**-7 * theirs.norm() + 1e-7
