"""Objective properties from ALGORITHMS.md: PPO-clip, GSPO (4), MISC (1.2), IcePop (3), TIS/MIS (5), WPSM (1.3)."""

import math

import pytest
import torch

from flashreinforce.algorithms import GlobalNorm, LossInputs, hinted_prompt, wpsm_weights
from flashreinforce.algorithms.objectives import (
    clip_objective,
    gspo_objective,
    gspo_token_objective,
    misc_objective,
)
from flashreinforce.algorithms.surrogates import gspo_log_ratio, ppo_clip

F64 = dict(dtype=torch.float64)


def norm_for(mask, max_new_tokens=8):
    return GlobalNorm(num_sequences=mask.shape[0], num_tokens=int(mask.sum()), reward_mean=0.0,
                      max_new_tokens=max_new_tokens)


def run(objective, policy, advantages, *, old=None, behavior=None, mask=None, weights=None, modalities=None,
        norm=None, **options):
    """Evaluate an objective on a fresh leaf copy of `policy`; returns (loss, stats, grad)."""
    live = policy.clone().requires_grad_()
    mask = torch.ones(policy.shape, dtype=torch.bool) if mask is None else mask
    old = policy.clone() if old is None else old
    inputs = LossInputs(policy_logprobs=live, old_logprobs=old, behavior_logprobs=old if behavior is None else behavior,
                        loss_mask=mask, advantages=advantages, rewards=torch.zeros(policy.shape[0], **F64),
                        sequence_weights=weights, modalities=modalities)
    loss, stats = objective(inputs, norm or norm_for(mask), **options)
    loss.backward()
    return loss, stats, live.grad


def test_ppo_clip_hand_values_and_clip_indicator():
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1])
    advantages = torch.tensor([2.0, -2.0, -2.0, 2.0, 2.0])
    surrogate, clipped = ppo_clip(ratio, advantages, 0.2, 0.28)
    torch.testing.assert_close(surrogate, torch.tensor([2.56, -3.0, -1.6, 1.0, 2.2]))
    assert clipped.tolist() == [True, False, True, False, False]


def test_grpo_at_theta_old_without_mismatch_has_the_reinforce_gradient():
    policy = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], **F64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    advantages = torch.tensor([1.0, -2.0], **F64)
    loss, stats, grad = run(clip_objective, policy, advantages, mask=mask)
    # -(1/B) A_i / T_i per token: row 0 -1/6, row 1 +2/4
    expected = torch.tensor([[-1 / 6, -1 / 6, -1 / 6], [0.5, 0.5, 0.0]], **F64)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-15)
    assert loss.item() == pytest.approx(-(1.0 - 2.0) / 2)  # ratio 1: loss = -mean_i A_i
    assert stats["clip_fraction"].item() == 0


def test_dapo_token_mean_and_drgrpo_length_independent_weights():
    policy = torch.full((2, 4), -1.0, **F64)
    mask = torch.tensor([[True, True, True, True], [True, False, False, False]])
    advantages = torch.tensor([1.0, 1.0], **F64)
    _, _, token_mean = run(clip_objective, policy, advantages, mask=mask, aggregation="token-mean")
    assert token_mean[mask].eq(-1 / 5).all()  # every token -A / N_tokens, whatever its row length
    _, _, sum_norm = run(clip_objective, policy, advantages, mask=mask, aggregation="seq-mean-token-sum-norm")
    assert sum_norm[mask].eq(-1 / 16).all()  # -A / (L B) = -1 / (8 * 2)


def test_clipped_tokens_get_zero_gradient():
    policy = torch.tensor([[-0.5, -0.5], [-0.5, -0.5]], **F64)
    old = policy + torch.tensor([[-0.5, 0.0], [0.5, 0.0]], **F64)  # r = e^0.5 (row 0), e^-0.5 (row 1)
    _, stats, grad = run(clip_objective, policy, torch.tensor([1.0, -1.0], **F64), old=old)
    assert grad[:, 0].eq(0).all() and grad[:, 1].ne(0).all()
    assert stats["clip_fraction"].item() == 0.5


# ---- GSPO (section 4) ----

def drifted(seed=0, rows=4, width=5):
    g = torch.Generator().manual_seed(seed)
    policy = -torch.rand(rows, width, generator=g, **F64) - 0.1
    old = policy + 0.05 * torch.randn(rows, width, generator=g, **F64)
    mask = torch.arange(width)[None, :] < torch.tensor([5, 2, 4, 3])[:rows, None]
    return policy, old, mask


def test_gspo_at_theta_old_is_sequence_mean_reinforce():
    policy, _, mask = drifted()
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0], **F64)
    _, stats, grad = run(gspo_objective, policy, advantages, mask=mask)
    assert stats["sequence_ratio"].eq(1).all()
    expected = -(advantages[:, None] / mask.sum(-1, keepdim=True)) / 4 * mask
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-15)


def sequence_form_gspo(policy, old, mask, advantages, eps_low, eps_high):
    """GSPO as the paper writes it: one ratio s_i per row, -mean_i min(s_i A_i, clip(s_i) A_i)."""
    live = policy.clone().requires_grad_()
    s = gspo_log_ratio(torch.where(mask, live - old, 0.0), mask).exp()
    loss = -torch.minimum(s * advantages, s.clamp(1 - eps_low, 1 + eps_high) * advantages).mean()
    loss.backward()
    return loss, live.grad


def test_gspo_and_gspo_token_with_uniform_advantage_equal_the_sequence_form():
    policy, old, mask = drifted()
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0], **F64)
    options = dict(old=old, mask=mask, eps_low=0.005, eps_high=3e-4)  # s = [.997, .991, 1.0004, .968]
    reference_loss, reference_grad = sequence_form_gspo(policy, old, mask, advantages, 0.005, 3e-4)
    loss, stats, grad = run(gspo_objective, policy, advantages, **options)
    token_loss, token_stats, token_grad = run(gspo_token_objective, policy, advantages, **options)
    assert 0 < stats["clip_fraction"] < 1  # some rows clipped, some not
    for value, gradient in ((loss, grad), (token_loss, token_grad)):
        torch.testing.assert_close(value, reference_loss, rtol=0, atol=1e-15)
        torch.testing.assert_close(gradient, reference_grad, rtol=0, atol=1e-15)
    torch.testing.assert_close(token_stats["clip_fraction"], stats["clip_fraction"])


@pytest.mark.parametrize("mismatch", ["icepop", "mis"])
def test_gspo_token_level_correction_removes_exactly_the_rejected_tokens_gradient(mismatch):
    """A token-level weight belongs to its own token (verl): a rejected token gets 0, its neighbours keep theirs."""
    policy = torch.full((1, 4), -1.0, **F64)
    behavior = policy - torch.tensor([[0.0, 0.0, 1.0, 0.0]], **F64)  # rho = e > 2 on token 2 only
    options = dict(behavior=behavior, mismatch=mismatch, icepop_band=(0.5, 2.0), mismatch_cap=2.0)
    _, stats, grad = run(gspo_objective, policy, torch.tensor([1.0], **F64), **options)
    _, _, token_grad = run(gspo_token_objective, policy, torch.tensor([1.0], **F64), **options)
    assert grad[0, 2].item() == 0 and grad[0].ne(0).tolist() == [True, True, False, True]
    torch.testing.assert_close(grad[0, [0, 1, 3]], torch.full((3,), -1 / 4, **F64), rtol=0, atol=1e-15)  # -(1/T) s A
    torch.testing.assert_close(grad, token_grad, rtol=0, atol=1e-15)
    assert stats["mismatch/masked_fraction"].item() == pytest.approx(1 / 4)


def test_gspo_ratio_is_length_invariant_and_positive():
    for length in (1, 3, 50):
        log_ratio = torch.full((1, length), math.log(1.3), **F64)
        assert gspo_log_ratio(log_ratio, torch.ones(1, length, dtype=torch.bool)).exp().item() == pytest.approx(1.3)
    huge = torch.full((1, 4), -30.0, **F64)
    assert gspo_log_ratio(huge, torch.ones(1, 4, dtype=torch.bool)).exp().item() > 0


@pytest.mark.parametrize("shift,advantage", [(0.1, 1.0), (-0.1, -1.0)])
def test_gspo_clipped_sequence_gets_zero_gradient_on_every_token(shift, advantage):
    policy = torch.full((2, 3), -1.0, **F64)
    old = policy - torch.tensor([[shift], [0.0]], **F64)  # s_0 = e^shift, beyond 1 +- 4e-4
    _, stats, grad = run(gspo_objective, policy, torch.tensor([advantage, 1.0], **F64), old=old,
                         eps_low=3e-4, eps_high=4e-4)
    assert grad[0].eq(0).all() and grad[1].ne(0).all()
    assert stats["clip_fraction"].item() == 0.5


def test_gspo_rejects_per_token_advantages():
    policy, _, mask = drifted()
    with pytest.raises(ValueError, match="gspo_token"):
        run(gspo_objective, policy, torch.ones(4, 5, **F64), mask=mask)


# ---- MISC (section 1.2) ----

def test_misc_without_mismatch_equals_gspo():
    policy, old, mask = drifted()
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0], **F64)
    options = dict(old=old, mask=mask, eps_low=0.005, eps_high=3e-4)  # two of four rows clipped
    loss, _, grad = run(gspo_objective, policy, advantages, **options)
    misc_loss, stats, misc_grad = run(misc_objective, policy, advantages, **options)  # behavior == old: rho = 1
    torch.testing.assert_close(misc_loss, loss, rtol=0, atol=1e-15)
    torch.testing.assert_close(misc_grad, grad, rtol=0, atol=1e-15)
    assert stats["mismatch/masked_fraction"].item() == 0


def test_misc_out_of_band_token_loses_only_its_own_gradient():
    policy = torch.full((1, 3), -1.0, **F64)
    behavior = policy - torch.tensor([[0.0, 1.0, 0.0]], **F64)  # rho = e^1 > 2 on token 1 only
    _, stats, grad = run(misc_objective, policy, torch.tensor([1.0], **F64), behavior=behavior,
                         icepop_band=(0.5, 2.0))
    assert grad[0].ne(0).tolist() == [True, False, True]
    assert stats["mismatch/masked_fraction"].item() == pytest.approx(1 / 3)
    # ... whereas the value_mask ablation keeps gradient on every token, scaled by mean_j M_j = 2/3
    _, _, ablation = run(misc_objective, policy, torch.tensor([1.0], **F64), behavior=behavior,
                         icepop_band=(0.5, 2.0), misc_impl="value_mask")
    torch.testing.assert_close(ablation[0], torch.full((3,), -2 / 3 / 3, **F64), rtol=0, atol=1e-15)


def test_misc_sequence_ratio_runs_over_masked_tokens_too():
    policy = torch.full((1, 3), -1.0, **F64)
    old = policy - torch.tensor([[0.3, 0.0, 0.0]], **F64)  # log r = 0.3 on the token that gets masked
    behavior = old - torch.tensor([[2.0, 0.0, 0.0]], **F64)  # rho = e^2 on that token: out of band
    _, stats, grad = run(misc_objective, policy, torch.tensor([-1.0], **F64), old=old, behavior=behavior,
                         icepop_band=(0.5, 2.0), eps_low=0.5, eps_high=0.5)
    assert stats["sequence_ratio"].item() == pytest.approx(math.exp(0.1))  # mean over all 3 tokens
    # unclipped: token j gets -(1/3) * s * A, except the masked one
    torch.testing.assert_close(grad[0], torch.tensor([0.0, 1, 1], **F64) * math.exp(0.1) / 3, rtol=1e-14, atol=0)


def test_gspo_with_sequence_icepop_silences_a_whole_out_of_band_response():
    policy = torch.full((2, 3), -1.0, **F64)
    behavior = policy - torch.tensor([[0.9, 0.9, 0.9], [0.9, -0.9, 0.0]], **F64)  # geometric rho e^0.9, then 1
    _, stats, grad = run(gspo_objective, policy, torch.tensor([1.0, 1.0], **F64), behavior=behavior,
                         mismatch="seq_icepop", seq_icepop_band=(0.5, 2.0))
    assert grad[0].eq(0).all() and grad[1].ne(0).all()  # ERNIE eq. 2: all of row 0 goes, row 1 stays whole
    assert stats["mismatch/masked_fraction"].item() == 0.5


def test_the_sequence_band_is_its_own_setting_apart_from_the_token_band():
    """Row geometric means 1.02 and 1.005 (token ratios up to e^0.5): IcePop's token band [0.5, 5] keeps every
    token, while seq_icepop's band (default [0.99, 1.01]) drops the first row whole and keeps the second."""
    policy = torch.full((2, 4), -1.0, **F64)
    log_rho = torch.tensor([[0.5, -0.5, 0.5, -0.5 + 4 * math.log(1.02)], [0.02, 0.0, -0.0, 4 * math.log(1.005) - 0.02]],
                           **F64)
    _, token, _ = run(gspo_objective, policy, torch.tensor([1.0, 1.0], **F64), behavior=policy - log_rho,
                      mismatch="icepop")
    assert token["mismatch/masked_fraction"].item() == 0
    _, sequence, grad = run(gspo_objective, policy, torch.tensor([1.0, 1.0], **F64), behavior=policy - log_rho,
                            mismatch="seq_icepop")
    assert grad[0].eq(0).all() and grad[1].ne(0).all() and sequence["mismatch/masked_fraction"].item() == 0.5


def test_misc_in_band_weight_is_rho_and_edges_are_inclusive():
    policy = torch.full((1, 3), -1.0, **F64)
    log_c = math.log(1.5)
    behavior = policy - torch.tensor([[0.0, log_c, math.log(0.5)]], **F64)  # rho = 1, 1.5, 0.5
    low, high = math.exp(math.log(0.5)), math.exp(log_c)  # the exact values exp() returns: both edges
    _, stats, grad = run(misc_objective, policy, torch.tensor([1.0], **F64), behavior=behavior, icepop_band=(low, high))
    torch.testing.assert_close(grad[0] / grad[0, 0], torch.tensor([1.0, high, low], **F64), rtol=1e-14, atol=0)
    assert stats["mismatch/masked_fraction"].item() == 0


def test_misc_uses_per_modality_bands():
    policy = torch.full((2, 2), -1.0, **F64)
    behavior = policy - 0.5  # rho = e^0.5 = 1.65 everywhere
    table = {"image": (0.9, 1.1, 3e-4, 4e-4)}  # image rows are stricter than the (0.5, 5) default
    _, stats, grad = run(misc_objective, policy, torch.tensor([1.0, 1.0], **F64), behavior=behavior,
                         modalities=("text", "image"), modality_bands=table)
    assert grad[0].ne(0).all() and grad[1].eq(0).all()
    assert stats["mismatch/masked_fraction"].item() == 0.5


def test_misc_sends_no_gradient_through_rho():
    policy, old, mask = drifted()
    old = old.clamp(max=0).requires_grad_()
    behavior = (old.detach() - 0.1).requires_grad_()
    live = policy.clone().requires_grad_()
    inputs = LossInputs(policy_logprobs=live, old_logprobs=old, behavior_logprobs=behavior, loss_mask=mask,
                        advantages=torch.tensor([1.0, -1.0, 0.5, 2.0], **F64), rewards=torch.zeros(4, **F64))
    loss, stats = misc_objective(inputs, norm_for(mask))
    loss.backward()
    assert old.grad is None and behavior.grad is None and live.grad is not None
    assert not any(v.requires_grad for v in stats.values())


# ---- IcePop on GRPO (section 3) and TIS / MIS (section 5) ----

def mismatched():
    policy = torch.full((2, 3), -1.0, **F64)
    old = policy + torch.tensor([[0.01, -0.02, 0.0], [0.0, 0.03, -0.01]], **F64)
    shift = torch.tensor([[0.0, 2.0, math.log(0.5)], [-0.1, 0.2, 0.0]], **F64)  # log rho
    return policy, old, old - shift, torch.tensor([1.0, -0.5], **F64)


@pytest.mark.parametrize("mode", ["icepop", "tis", "mis", "seq_tis", "seq_mis", "seq_icepop", "geo_rs"])
def test_no_mismatch_leaves_the_base_loss_unchanged(mode):
    policy, old, _, advantages = mismatched()
    base, _, base_grad = run(clip_objective, policy, advantages, old=old)
    loss, stats, grad = run(clip_objective, policy, advantages, old=old, behavior=old, mismatch=mode)
    torch.testing.assert_close(loss, base, rtol=0, atol=0)
    torch.testing.assert_close(grad, base_grad, rtol=0, atol=0)
    assert stats["mismatch/weight_mean"].item() == 1 and stats["mismatch/kl"].item() == 0


def test_icepop_on_grpo_drops_out_of_band_tokens_and_weights_in_band_ones_by_rho():
    policy, old, behavior, advantages = mismatched()
    _, _, base_grad = run(clip_objective, policy, advantages, old=old)
    low = math.exp(math.log(0.5))
    _, stats, grad = run(clip_objective, policy, advantages, old=old, behavior=behavior, mismatch="icepop",
                         icepop_band=(low, 5.0))
    rho = torch.tensor([[1.0, 0.0, low], [math.exp(-0.1), math.exp(0.2), 1.0]], **F64)  # e^2 = 7.4 > 5: dropped
    torch.testing.assert_close(grad, base_grad * rho, rtol=1e-14, atol=0)
    assert stats["mismatch/masked_fraction"].item() == pytest.approx(1 / 6)  # mean(w == 0) over loss tokens


def test_tis_and_mis_on_grpo_cap_or_drop():
    policy, old, behavior, advantages = mismatched()
    _, _, base_grad = run(clip_objective, policy, advantages, old=old)
    _, _, tis = run(clip_objective, policy, advantages, old=old, behavior=behavior, mismatch="tis", mismatch_cap=2.0)
    _, _, mis = run(clip_objective, policy, advantages, old=old, behavior=behavior, mismatch="mis", mismatch_cap=2.0)
    assert tis[0, 1] / base_grad[0, 1] == pytest.approx(2.0)  # rho = e^2 truncated to C
    assert mis[0, 1] == 0  # ... or masked
    torch.testing.assert_close(tis[1], mis[1])  # rho <= C elsewhere: both weigh rho


# ---- WPSM weights inside an objective (section 1.3) ----

def test_wpsm_alpha_zero_is_the_base_objective_and_alpha_one_silences_flagged_rows_only():
    policy, old, mask = drifted()
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0], **F64)
    flags = torch.tensor([True, False, False, True])
    base, _, base_grad = run(clip_objective, policy, advantages, old=old, mask=mask)
    off, _, off_grad = run(clip_objective, policy, advantages, old=old, mask=mask,
                           weights=wpsm_weights(flags, 0.0).double())
    torch.testing.assert_close(off, base, rtol=0, atol=0)
    torch.testing.assert_close(off_grad, base_grad, rtol=0, atol=0)
    _, _, grad = run(clip_objective, policy, advantages, old=old, mask=mask, weights=wpsm_weights(flags, 1.0).double())
    assert grad[flags].eq(0).all()
    torch.testing.assert_close(grad[~flags], base_grad[~flags], rtol=0, atol=0)  # same B, same T_i


# ---- AHRL hint tokens (section 1.4, property 3) ----

def test_hint_tokens_are_prompt_and_never_get_gradient():
    prompt, hint_length = hinted_prompt((1, 2), (7, 8, 9, 10), 0.5, think_open_ids=(5,))
    generated = 3
    row = len(prompt) + generated
    mask = torch.zeros(1, row, dtype=torch.bool)
    mask[0, len(prompt):] = True  # loss only on generated tokens: not the prompt, not the hint
    _, _, grad = run(clip_objective, torch.full((1, row), -1.0, **F64), torch.tensor([1.0], **F64), mask=mask)
    assert hint_length == 3 and grad[0, : len(prompt)].eq(0).all()
    assert grad[0, len(prompt):].eq(-1 / generated).all()  # |y_i| counts generated tokens only


def test_slice_larger_than_global_norm_is_rejected():
    policy, _, mask = drifted()
    small = GlobalNorm(num_sequences=2, num_tokens=100, reward_mean=0.0, max_new_tokens=8)
    with pytest.raises(ValueError, match="whole learner batch"):
        run(clip_objective, policy, torch.ones(4, **F64), mask=mask, norm=small)


@pytest.mark.parametrize("field,value", [("num_sequences", 0), ("num_tokens", 1.5), ("reward_mean", math.nan),
                                         ("max_new_tokens", True)])
def test_global_norm_validates_its_fields(field, value):
    kwargs = dict(num_sequences=2, num_tokens=3, reward_mean=0.0, max_new_tokens=8) | {field: value}
    with pytest.raises(ValueError, match=field):
        GlobalNorm(**kwargs)


@pytest.mark.parametrize("broken", ["mask_dtype", "empty_row", "nan_policy", "positive_old", "advantages_shape",
                                    "modalities", "weights"])
def test_loss_inputs_validate_on_construction(broken):
    policy = torch.full((2, 3), -1.0)
    fields = dict(policy_logprobs=policy, old_logprobs=policy, behavior_logprobs=policy,
                  loss_mask=torch.ones(2, 3, dtype=torch.bool), advantages=torch.ones(2), rewards=torch.ones(2))
    if broken == "mask_dtype":
        fields["loss_mask"] = torch.ones(2, 3)
    if broken == "empty_row":
        fields["loss_mask"] = torch.tensor([[True, True, True], [False, False, False]])
    if broken == "nan_policy":
        fields["policy_logprobs"] = torch.tensor([[-1.0, math.nan, -1.0], [-1.0, -1.0, -1.0]])
    if broken == "positive_old":
        fields["old_logprobs"] = torch.full((2, 3), 0.5)
    if broken == "advantages_shape":
        fields["advantages"] = torch.ones(3)
    if broken == "modalities":
        fields["modalities"] = ("text",)
    if broken == "weights":
        fields["sequence_weights"] = torch.tensor([1.0, -1.0])
    with pytest.raises(ValueError, match="LossInputs"):
        LossInputs(**fields)
