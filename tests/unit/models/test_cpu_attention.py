"""The trainer's fp32 attention on a CPU in half precision (models/cpu_attention.py): transformers' SDPA of the
upcast inputs, switched to only where it applies, switched back by an engine, and trained with as before."""

import copy

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flashreinforce.models import build_model, token_logprobs
from flashreinforce.models.cpu_attention import (
    FP32_SDPA,
    UPCAST_LIMIT,
    fp32_sdpa_attention,
    use_fp32_attention,
)
from flashreinforce.models.families import engine_attention
from flashreinforce.models.packing import packing_problem
from flashreinforce.trainer.trainer import OptimizerSettings, Trainer
from flashreinforce.types import Prompt, RolloutKey, Trajectory, Verdict

CPU = torch.device("cpu")


def _qkv(dtype, heads=4, kv_heads=2):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, heads, 11, 16, generator=g).to(dtype)
    k, v = (torch.randn(3, kv_heads, 11, 16, generator=g).to(dtype) for _ in range(2))
    return q, k, v


class _Module(torch.nn.Module):
    """What transformers' sdpa_attention_forward reads from an attention module."""

    is_causal = True
    num_key_value_groups = 2


def test_half_precision_attends_in_fp32_and_returns_its_dtype():
    q, k, v = _qkv(torch.bfloat16)
    output, _ = fp32_sdpa_attention(_Module(), q, k, v, None, dropout=0.0, scaling=None)
    reference, _ = sdpa_attention_forward(_Module(), q.float(), k.float(), v.float(), None, dropout=0.0, scaling=None)
    assert output.dtype == torch.bfloat16
    assert torch.equal(output, reference.to(torch.bfloat16))
    plain, _ = sdpa_attention_forward(_Module(), q, k, v, None, dropout=0.0, scaling=None)
    assert not torch.equal(output, plain)  # the bf16 kernel adds in bf16: the upcast is not a no-op


def test_long_keys_stay_in_half_precision_where_its_kernel_is_the_faster():
    g = torch.Generator().manual_seed(0)
    positions = UPCAST_LIMIT // 16 + 1  # one position past the limit at a head width of 16
    q, k, v = (torch.randn(1, 2, positions, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    output, _ = fp32_sdpa_attention(_Module(), q, k, v, None, dropout=0.0, scaling=None)
    assert torch.equal(output, sdpa_attention_forward(_Module(), q, k, v, None, dropout=0.0, scaling=None)[0])
    shorter = [t[:, :, : UPCAST_LIMIT // 16] for t in (q, k, v)]  # at the limit: upcast
    upcast, _ = fp32_sdpa_attention(_Module(), *shorter, None, dropout=0.0, scaling=None)
    reference, _ = sdpa_attention_forward(_Module(), *(t.float() for t in shorter), None, dropout=0.0, scaling=None)
    assert torch.equal(upcast, reference.to(torch.bfloat16))


def test_fp32_inputs_are_transformers_sdpa_untouched():
    q, k, v = _qkv(torch.float32)
    output, _ = fp32_sdpa_attention(_Module(), q, k, v, None, dropout=0.0, scaling=None)
    assert torch.equal(output, sdpa_attention_forward(_Module(), q, k, v, None, dropout=0.0, scaling=None)[0])


def test_switched_only_for_half_precision_on_a_cpu():
    model = build_model(16, 32, 1, 2, 32)
    assert not use_fp32_attention(model, CPU, torch.float32)
    assert not use_fp32_attention(model, torch.device("cuda"), torch.bfloat16)
    assert model.config._attn_implementation == "sdpa"
    eager = build_model(16, 32, 1, 2, 32)
    eager.set_attn_implementation("eager")
    assert not use_fp32_attention(eager, CPU, torch.bfloat16) and eager.config._attn_implementation == "eager"
    assert use_fp32_attention(model, CPU, torch.bfloat16)
    assert model.config._attn_implementation == FP32_SDPA
    assert packing_problem(model) is None  # packed rows train with it as with sdpa


def test_a_class_that_cannot_switch_attention_keeps_sdpa(monkeypatch):
    model = build_model(16, 32, 1, 2, 32)
    monkeypatch.setattr(type(model), "_can_set_attn_implementation", lambda self: False)
    assert not use_fp32_attention(model, CPU, torch.bfloat16)
    assert model.config._attn_implementation == "sdpa"


def test_an_engine_copy_goes_back_to_sdpa_and_the_trainer_keeps_it():
    model = build_model(16, 32, 1, 2, 32)
    use_fp32_attention(model, CPU, torch.bfloat16)
    copied = copy.deepcopy(model)
    assert engine_attention(copied, copied.config) == "sdpa" and copied.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == FP32_SDPA


def test_switched_model_gives_the_upcast_forward_and_saves_as_sdpa(tmp_path):
    torch.manual_seed(0)
    model = build_model(16, 32, 2, 4, 64).to(torch.bfloat16)
    plain = copy.deepcopy(model)
    use_fp32_attention(model, CPU, torch.bfloat16)
    ids = torch.randint(2, 16, (3, 40))
    mask = torch.ones_like(ids, dtype=torch.bool)
    switched, _ = token_logprobs(model, ids, mask, temperature=1.0)
    unswitched, _ = token_logprobs(plain, ids, mask, temperature=1.0)
    gap = (switched.float() - unswitched.float()).abs().max().item()
    assert 0 < gap < 0.1  # the same model, the attention's sums in another precision
    model.save_pretrained(tmp_path)
    assert FP32_SDPA not in (tmp_path / "config.json").read_text()


def _rows(vocab, count=6):
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(count):
        n = 8 + 3 * i
        mask = tuple(int(j >= 4) for j in range(n))
        rows.append(Trajectory(key=RolloutKey(f"p{i}", 0), prompt=Prompt(f"p{i}", "x", "y"), group=i,
                               tokens=tuple(torch.randint(2, vocab, (n,), generator=g).tolist()), loss_mask=mask,
                               behavior_logprobs=tuple(-2.0 * m for m in mask), policy_versions=(0,) * n,
                               prompt_length=4, finish_reason="stop", verdict=Verdict(reward=float(i % 2),
                                                                                      passed=bool(i % 2))))
    return rows


def _trainer(model, precision):
    from flashreinforce.models.numerics import Numerics

    return Trainer(model, loss="flashreinforce", loss_options={"delta": 1e9}, microbatch_size=3, pad_token_id=0,
                   temperature=1.0, max_new_tokens=32, numerics=Numerics(precision=precision),
                   optimizer=OptimizerSettings(1e-3, 0.0, (0.9, 0.999), 0, 10, 1.0, 1.0))


def test_a_bf16_trainer_on_a_cpu_trains_with_fp32_attention_and_fp32_stays_sdpa():
    torch.manual_seed(0)
    base = build_model(16, 32, 2, 4, 64)
    bf16, fp32 = _trainer(copy.deepcopy(base), "bf16"), _trainer(copy.deepcopy(base), "fp32")
    assert bf16.model.config._attn_implementation == FP32_SDPA
    assert fp32.model.config._attn_implementation == "sdpa"
    rows = _rows(16)
    bf16_metrics, fp32_metrics = bf16.step(rows), fp32.step(rows)
    # the same gradient up to bf16's rounding of the rest of the step
    assert abs(bf16_metrics["optim/grad_norm"] - fp32_metrics["optim/grad_norm"]) < 0.05 * fp32_metrics["optim/grad_norm"]
