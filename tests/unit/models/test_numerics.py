"""Weight formats (fp32 / bf16 / fp8 fake-quantized) and the unified mode: the engine's behavior log-probs and
the trainer's recompute agree to float rounding when both sides hold the same formatted weights and compute in
fp32, and disagree visibly when a side computes with its own bf16 kernels."""

import copy

import pytest
import torch

from flashreinforce.config import load_config
from flashreinforce.models import build_model
from flashreinforce.models.logprobs import token_logprobs
from flashreinforce.models.numerics import (
    E4M3_MAX,
    Numerics,
    fake_quant_e4m3,
    format_state,
    fp8_parameter_names,
)
from flashreinforce.rollout.engine import Engine
from flashreinforce.trainer.precision import MasterWeights
from flashreinforce.types import SamplingParams


@pytest.mark.parametrize("scaling", ["tensor", "channel", "block"])
def test_fake_quant_is_idempotent_and_within_e4m3_rounding(scaling):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(70, 50, generator=generator) * torch.logspace(-3, 0, 50)  # columns of mixed scale
    quantized = fake_quant_e4m3(weight, scaling, block=16)
    assert torch.equal(fake_quant_e4m3(quantized, scaling, block=16), quantized)
    assert not torch.equal(quantized, weight)
    # e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself; subnormals by half a step.
    big = weight.abs() > weight.abs().max() / 64
    relative = ((quantized - weight).abs() / weight.abs())[big]
    assert float(relative.max()) <= 2**-4 + 1e-6


def test_fake_quant_scales_are_powers_of_two_per_group():
    weight = torch.tensor([[1.1, -3.3, 0.013], [0.0, 0.0, 0.0], [1000.0, 2.0, 7.0]])
    quantized = fake_quant_e4m3(weight, "channel")
    assert torch.equal(quantized[1], torch.zeros(3))  # an all-zero row stays zero
    # Row 0: amax 3.3 -> scale 2^-7 (3.3 / 2^-7 = 422 <= 448); every value is an e4m3 code times it, exactly.
    codes = quantized[0] / 2**-7
    assert torch.equal(codes.to(torch.float8_e4m3fn).float(), codes)
    codes = quantized[2] / 4  # row 2: amax 1000 -> scale 2^2 (1000 / 4 = 250 <= 448, 1000 / 2 > 448)
    assert torch.equal(codes.to(torch.float8_e4m3fn).float(), codes) and float(codes.abs().max()) <= E4M3_MAX
    # Per-tensor: one scale for all rows, so row 0's small values lose precision that per-channel kept.
    per_tensor = fake_quant_e4m3(weight, "tensor")
    assert (per_tensor[0] - weight[0]).abs().sum() > (quantized[0] - weight[0]).abs().sum()


def test_block_scaling_gives_each_tile_its_own_scale_and_experts_their_own():
    weight = torch.ones(4, 4) * 0.01
    weight[:2, :2] = 1e4  # one loud tile: under one scale for the tensor, 0.01 rounds to zero
    per_block = fake_quant_e4m3(weight, "block", block=2)
    per_tensor = fake_quant_e4m3(weight, "tensor")
    assert torch.allclose(per_block[2:, 2:], weight[2:, 2:], rtol=2**-4)
    assert (per_tensor[2:, 2:] - weight[2:, 2:]).abs().max() > (per_block[2:, 2:] - weight[2:, 2:]).abs().max()
    experts = torch.stack([weight, weight * 1e-6])  # (E, out, in): the quiet expert is not crushed by the loud one
    stacked = fake_quant_e4m3(experts, "tensor")
    assert stacked.shape == experts.shape
    assert torch.equal(stacked[1], fake_quant_e4m3(experts[1], "tensor"))
    assert torch.allclose(stacked[1, :2, :2], experts[1, :2, :2], rtol=2**-4)  # 0.01 survives: its own scale


def test_fp8_applies_to_decoder_linear_weights_only():
    model = build_model(32, 32, 2, 2, 32)
    names = fp8_parameter_names(model)
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.layers.1.mlp.down_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n or "norm" in n or n.endswith(".bias") for n in names)


def test_format_state_rounds_to_bf16_and_quantizes_fp8_linear_weights():
    model = build_model(32, 32, 1, 2, 32)
    state = model.state_dict()
    names = fp8_parameter_names(model)
    bf16 = format_state(state, Numerics("bf16"), names)
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    fp8_unified = format_state(state, Numerics("fp8", unified=True), names)
    for name, tensor in fp8_unified.items():
        assert tensor.dtype == torch.float32
        expected = fake_quant_e4m3(state[name]) if name in names else state[name].bfloat16().float()
        assert torch.equal(tensor, expected), name


def _sharp_model():
    model = build_model(48, 64, 2, 4, 96, eos_token_id=1, pad_token_id=0, seed=3)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(3.0)  # peaked distributions, like a trained model's, where rounding shows
    return model


def _max_gap(trainer_numerics: Numerics, rollout_numerics: Numerics) -> float:
    """Largest |behavior - recomputed| log-prob over 16 sampled responses on the same weights."""
    base = _sharp_model()
    trainer_model = copy.deepcopy(base)
    MasterWeights(trainer_model, trainer_numerics)
    engine = Engine(copy.deepcopy(base), max_batch_size=16, max_context=90, eos_token_ids=1,
                    numerics=rollout_numerics)
    engine.load_weights(trainer_model.state_dict(), version=0)
    generator = torch.Generator().manual_seed(1)
    for i in range(16):
        engine.submit(str(i), torch.randint(2, 48, (6,), generator=generator).tolist(),
                      SamplingParams(max_new_tokens=40, seed=i))
    finished = []
    while engine.has_work:
        finished += engine.step()
    gaps = []
    for generation in finished:
        ids = torch.tensor([[*generation.prompt_ids, *generation.token_ids]])
        with torch.no_grad():
            recomputed, _ = token_logprobs(trainer_model, ids, with_entropy=False)
        behavior = torch.tensor(generation.behavior_logprobs)
        gaps.append((recomputed[0, len(generation.prompt_ids):] - behavior).abs())
    return float(torch.cat(gaps).max())


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_unified_mode_agrees_to_float_rounding_and_separate_does_not(precision):
    unified = _max_gap(Numerics(precision, unified=True), Numerics(precision, unified=True))
    separate = _max_gap(Numerics(precision), Numerics(precision))
    rollout_only = _max_gap(Numerics("fp32"), Numerics(precision))
    assert unified < 1e-4  # fp32 kernels on both sides: only accumulation order differs
    assert separate > 100 * unified
    assert rollout_only > separate  # a low-precision rollout against an fp32 trainer is the worst case


def test_master_weights_keep_fp32_and_write_formatted_weights():
    model = build_model(32, 32, 1, 2, 32)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters = MasterWeights(model, Numerics("fp8"))
    names = fp8_parameter_names(model)
    assert next(model.parameters()).dtype == torch.bfloat16
    for name, param in model.named_parameters():
        expected = fake_quant_e4m3(original[name]) if name in names else original[name]
        assert torch.equal(param.float(), expected.bfloat16().float()), name
    assert all(m.dtype == torch.float32 for m in masters.state_dict().values())
    assert torch.equal(masters.state_dict()["model.layers.0.mlp.up_proj.weight"],
                       original["model.layers.0.mlp.up_proj.weight"])


def test_precision_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="precision.trainer and precision.rollout"):
        load_config(None, ["model.dtype=bfloat16"])
    with pytest.raises(ValueError, match="set them equal or use mode=separate"):
        load_config(None, ["precision.mode=unified", "precision.rollout=bf16"])
    config = load_config(None, ["precision.mode=unified", "precision.rollout=fp8", "precision.trainer=fp8"])
    assert config.precision.fp8_scaling == "channel"
