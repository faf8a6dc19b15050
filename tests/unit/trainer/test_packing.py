"""trainer.pack: microbatches fed to the model packed give the padded path's log-probs, losses, metrics and step,
with router replay, mini-batches, gradient checkpointing, LoRA and bf16; a model that cannot be packed trains
padded, saying why."""

import copy
import math
import sys
from pathlib import Path

import pytest
import torch

from flashreinforce.models import build_model, token_logprobs
from flashreinforce.models.numerics import Numerics
from flashreinforce.trainer.batching import collate
from flashreinforce.trainer.lora import LoraSettings
from flashreinforce.trainer.trainer import OptimizerSettings, Trainer
from flashreinforce.types import FORCED_VERSION, Prompt, RolloutKey, Trajectory, Verdict

sys.path.insert(0, str(Path(__file__).parent))
from test_router_replay_trainer import _moe, _trajectories

VOCAB = 24
SKIPPED = {"time/train_seconds", "batch/padding_fraction"}
"""Metrics that differ by design: the step's wall time, and the padding the model was fed."""


def rows(count: int = 12, seed: int = 0, model: torch.nn.Module | None = None) -> list[Trajectory]:
    """A long-tailed batch: prompts of 2-5 tokens, responses of 1-30 (log-uniform), groups of 3, mixed rewards;
    behavior log-probs are `model`'s own (on-policy), else made up."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        prompt = 2 + int(torch.randint(0, 4, (1,), generator=g))
        response = int(math.exp(float(torch.rand(1, generator=g)) * math.log(30))) or 1
        tokens = torch.randint(2, VOCAB, (prompt + response,), generator=g)
        mask = tuple(int(j >= prompt) for j in range(len(tokens)))
        if model is None:
            behavior = [-1.5 * m for m in mask]
        else:
            with torch.no_grad():
                behavior = token_logprobs(model, tokens[None], with_entropy=False)[0][0].tolist()
        reward = float(i % 3 == 0)
        out.append(Trajectory(
            key=RolloutKey(f"p{i // 3}", i % 3), prompt=Prompt(id=f"p{i // 3}", prompt="x", ground_truth="1"),
            group=i // 3, tokens=tuple(tokens.tolist()), loss_mask=mask,
            behavior_logprobs=tuple(lp * m for lp, m in zip(behavior, mask)),
            policy_versions=tuple(0 if m else FORCED_VERSION for m in mask), prompt_length=prompt,
            finish_reason="stop", verdict=Verdict(reward=reward, passed=reward > 0)))
    return out


def tiny(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    return build_model(VOCAB, 32, 2, 4, 64, seed=4, dtype=dtype)


def trainer(model: torch.nn.Module, pack: bool, loss: str = "grpo", microbatch_size: int = 3, **options) -> Trainer:
    return Trainer(model, loss=loss, loss_options={}, microbatch_size=microbatch_size, pad_token_id=0,
                   temperature=1.0, max_new_tokens=32, pack=pack,
                   optimizer=OptimizerSettings(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=0,
                                               total_steps=10, min_lr_ratio=1.0, grad_clip=1e9), **options)


def assert_same_step(padded: Trainer, packed: Trainer, batch: list[Trajectory], *, atol: float, steps: int = 2,
                     weights_atol: float | None = None) -> tuple[dict, dict]:
    """Both trainers step `steps` times on `batch`: every optimizer step's gradients the same to `atol`, and the
    metrics (but SKIPPED; some are summed in fp32 whatever the model's dtype: to 1e-6 relative, 1e-7 absolute);
    with `weights_atol` the weights after. (In fp32 a weight whose gradient is only rounding noise, as a key
    projection's bias, moves by +-lr in AdamW's first step whichever way the noise falls: weights are compared in
    fp64 only.)"""
    grads: dict[Trainer, list[list[torch.Tensor]]] = {padded: [], packed: []}
    for built, kept in grads.items():
        built.optimizer.register_step_pre_hook(
            lambda *_, built=built, kept=kept: kept.append([p.grad.clone() for p in built.masters.params]))
    for _ in range(steps):
        expected, got = padded.step(batch), packed.step(batch)
        assert got.keys() == expected.keys()
        for name in expected.keys() - SKIPPED:
            assert got[name] == pytest.approx(expected[name], rel=1e-6, abs=max(atol, 1e-7)), name
    assert len(grads[packed]) == len(grads[padded]) >= steps
    for mine, theirs in zip(grads[packed], grads[padded]):
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=atol)
    if weights_atol is not None:
        for (name, mine), theirs in zip(packed.weights().items(), padded.weights().values()):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=weights_atol, msg=name)
    return expected, got


def test_packed_microbatches_cover_every_row_once_within_the_row_cap_and_token_budget():
    batch = collate(rows(), pad_token_id=0)
    lengths = batch.attention_mask.sum(1)
    width = int(lengths.max())
    for size, budget in ((3, None), (2, 3 * width), (8, width - 1)):
        micros = list(batch.packed_microbatches(size, budget))
        covered = torch.cat([index for index, _ in micros])
        assert sorted(covered.tolist()) == list(range(batch.num_rows))
        for index, micro in micros:
            packing = micro.packing
            assert packing.packed_rows <= size and packing.width <= width
            assert budget is None or packing.packed_rows * width <= max(budget, width)
            assert torch.equal(micro.input_ids, batch.select(index).input_ids)
            assert packing.cells >= int(lengths[index].sum())
    cells = sum(micro.packing.cells for _, micro in batch.packed_microbatches(3))
    padded = sum(micro.attention_mask.numel() for _, micro in batch.microbatches(3))
    assert cells < padded  # the point: less fed to the model than the sorted, trimmed padded slices


@pytest.mark.parametrize(("loss", "options"), [("grpo", {}), ("flashreinforce", {"minibatches": 2}),
                                               ("gspo", {"microbatch_tokens": 40}), ("dapo", {"minibatches": 3})])
def test_a_packed_step_is_the_padded_step(loss, options):
    """fp64, so any real difference would show far above rounding: losses, every metric, two steps' weights."""
    base = tiny()
    batch = rows(model=base)
    expected, got = assert_same_step(trainer(copy.deepcopy(base), False, loss, **options),
                                     trainer(copy.deepcopy(base), True, loss, **options), batch, atol=1e-10,
                                     weights_atol=1e-10)
    assert got["batch/padding_fraction"] < expected["batch/padding_fraction"]
    assert expected["optim/grad_norm"] > 1e-3


def test_packing_keeps_gradient_checkpointing_and_fp32_within_float_rounding():
    base = tiny(torch.float32)
    batch = rows(model=base)
    assert_same_step(trainer(copy.deepcopy(base), False), trainer(copy.deepcopy(base), True,
                                                                  gradient_checkpointing=True), batch, atol=2e-6)


@pytest.mark.parametrize("replay", [True, False])
def test_moe_routes_are_packed_with_their_tokens(replay):
    """Replayed (R3) or compared with the trainer's own choice: routes per token, packed as the tokens are."""
    model = _moe()
    batch = _trajectories(model, model.state_dict(), Numerics("bf16"), count=12)  # bf16 routes: some differ
    padded, packed = (trainer(copy.deepcopy(model), pack, "flashreinforce", 4, router_replay=replay)
                      for pack in (False, True))
    expected, got = assert_same_step(padded, packed, batch, atol=2e-6, steps=1)
    assert got["mismatch/route_disagreement"] == expected["mismatch/route_disagreement"] > 0


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_low_precision_packed_is_the_padded_path_within_bf16_rounding(precision):
    base = tiny(torch.float32)
    batch = rows(model=base)
    padded, packed = (trainer(copy.deepcopy(base), pack, numerics=Numerics(precision)) for pack in (False, True))
    expected, got = padded.step(batch), packed.step(batch)
    assert got["loss/policy"] == pytest.approx(expected["loss/policy"], abs=2e-2)
    assert got["mismatch/abs_logprob_diff"] == pytest.approx(expected["mismatch/abs_logprob_diff"], abs=2e-2)


@pytest.mark.parametrize("pack", [False, True])
def test_first_forward_is_the_steps_own_forward_token_by_token(pack):
    """Trainer.first_forward (what benchmarks/mismatch.py reads per token) repeats the step's first forward: its
    microbatches, packed where the trainer packs, and their log-probs, whose mean gap to the behavior log-probs is
    the step's own. (Where packed and padded forwards round apart, as in bf16 on an MoE model in the unified mode,
    that benchmark's test catches a recompute through the other path.)"""
    base = tiny(torch.float32)
    batch = rows()  # made-up behavior log-probs: gaps far above rounding
    built = trainer(copy.deepcopy(base), pack, numerics=Numerics("bf16"))
    forwards = built.first_forward(batch)
    assert {micro.packing is not None for micro, _ in forwards} == {pack}
    assert sum(micro.num_rows for micro, _ in forwards) == len(batch)
    gaps = [(logprobs - micro.behavior_logprobs)[micro.loss_mask].abs() for micro, logprobs in forwards]
    recomputed = float(torch.cat(gaps).double().mean())
    assert recomputed == pytest.approx(built.step(batch)["mismatch/same_weights_abs_mean"], rel=1e-6)
    assert recomputed > 0.5


@pytest.mark.lora
def test_lora_adapters_train_packed_as_padded():
    base = tiny(torch.float32)
    batch = rows(model=base)
    lora = LoraSettings(r=4, alpha=8.0)
    assert_same_step(trainer(copy.deepcopy(base), False, lora=lora), trainer(copy.deepcopy(base), True, lora=lora),
                     batch, atol=2e-6)


def test_a_model_that_cannot_be_packed_warns_and_trains_padded():
    from flashreinforce.models.vision import VisionConfig, build_vision_lm

    model = build_vision_lm(build_model(VOCAB, 32, 1, 2, 64), VisionConfig(image_token_id=1), seed=0)  # rows: 2..
    with pytest.warns(UserWarning, match="trainer.pack: VisionLM reads images.*trains padded"):
        built = trainer(model, True)
    assert not built.pack
    metrics = built.step(rows())
    assert 0 < metrics["batch/padding_fraction"] < 1
