"""The LOSSES contract: every entry evaluated on uneven slices sums to the full batch (normalization is global)."""

import pytest
import torch

from flashreinforce.algorithms import LOSSES, LossInputs, global_norm
from flashreinforce.algorithms.mismatch import MISMATCH_MODES

B, T = 5, 6
SLICES = ((0, 1), (1, 4), (4, 5))

# Options that make every branch do work: rejected rows, filtered tokens, masked tokens, modality bands.
OPTIONS = {
    "flashreinforce": {"delta": 0.02, "negative_token_fraction": 0.5},
    "misc": {"modality_bands": {"image": (0.8, 1.25, 0.05, 0.1)}, "eps_low": 0.02, "eps_high": 0.03},
    "gspo": {"mismatch": "seq_icepop", "seq_icepop_band": (0.97, 1.03)},
    "gspo_token": {"eps_low": 0.02, "eps_high": 0.03},
    "grpo": {"mismatch": "icepop", "icepop_band": (0.8, 1.25)},
    "dapo": {"mismatch": "tis", "mismatch_cap": 1.1},
    "opd": {"mismatch": "icepop", "icepop_band": (0.8, 1.25), "kl_clip": 0.5, "reward_weight": 0.5},
}


def make_batch(seed=0, dtype=torch.float64):
    """A learner batch with unequal lengths, NaN padding, policy drift and train/inference mismatch."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 2, 5, 1, 4])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    policy = -torch.rand(B, T, generator=g, dtype=dtype) * 2 - 0.05
    old = (policy + 0.15 * torch.randn(B, T, generator=g, dtype=dtype)).clamp(max=0)
    behavior = (old + 0.2 * torch.randn(B, T, generator=g, dtype=dtype)).clamp(max=0)
    teacher = (old + 0.5 * torch.randn(B, T, generator=g, dtype=dtype)).clamp(max=0)  # opd's teacher
    for t in (policy, old, behavior, teacher):
        t[~mask] = float("nan")
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=dtype)
    group_ids = torch.tensor([0, 0, 0, 1, 1])
    return dict(policy=policy, old=old, behavior=behavior, teacher=teacher, mask=mask, rewards=rewards, group_ids=group_ids,
                entropies=torch.rand(B, T, generator=g, dtype=dtype), failures=rewards == 0,
                weights=torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0], dtype=dtype),
                modalities=("text", "image", "image", "text", "audio"))


def inputs_for(batch, policy, advantages):
    return LossInputs(policy_logprobs=policy, old_logprobs=batch["old"], behavior_logprobs=batch["behavior"],
                      loss_mask=batch["mask"], advantages=advantages, rewards=batch["rewards"],
                      entropies=batch["entropies"], failures=batch["failures"], modalities=batch["modalities"],
                      sequence_weights=batch["weights"], teacher_logprobs=batch["teacher"])


def full_and_sliced(name, options):
    batch = make_batch()
    spec = LOSSES[name]
    advantages = spec.advantages(batch["rewards"], batch["group_ids"], batch["mask"].sum(-1))  # on the WHOLE batch
    norm = global_norm(batch["mask"], batch["rewards"], max_new_tokens=8)

    full_policy = batch["policy"].clone().requires_grad_()
    full_loss, full_stats = spec.objective(inputs_for(batch, full_policy, advantages), norm, **options)
    full_loss.backward()

    sliced_policy = batch["policy"].clone().requires_grad_()
    whole = inputs_for(batch, sliced_policy, advantages)
    parts = [spec.objective(whole.rows(start, stop), norm, **options) for start, stop in SLICES]
    sum(loss for loss, _ in parts).backward()
    return full_loss, full_stats, full_policy.grad, parts, sliced_policy.grad


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_uneven_slices_reproduce_full_batch_loss_gradient_and_stats(name):
    full_loss, full_stats, full_grad, parts, sliced_grad = full_and_sliced(name, OPTIONS.get(name, {}))
    assert torch.isfinite(full_loss) and full_grad.abs().sum() > 0
    torch.testing.assert_close(sum(loss for loss, _ in parts), full_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(sliced_grad, full_grad, rtol=0, atol=1e-12)
    for key, value in full_stats.items():
        assert not value.requires_grad, key
        pieces = [stats[key] for _, stats in parts]
        combined = torch.cat(pieces) if value.ndim == 1 else sum(pieces)  # per-row: concat; scalar: sum
        torch.testing.assert_close(combined, value, rtol=0, atol=1e-12, msg=f"{name} stat {key}")


@pytest.mark.parametrize("mode", MISMATCH_MODES)
def test_every_mismatch_mode_is_slice_additive(mode):
    options = {"mismatch": mode, "mismatch_cap": 1.2, "icepop_band": (0.8, 1.25), "geo_rs_band": (0.9, 1.1)}
    full_loss, _, full_grad, parts, sliced_grad = full_and_sliced("grpo", options)
    torch.testing.assert_close(sum(loss for loss, _ in parts), full_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(sliced_grad, full_grad, rtol=0, atol=1e-12)


def test_defaults_are_read_only_and_applied_when_no_option_is_given():
    spec = LOSSES["dapo"]
    assert spec.defaults["eps_high"] == 0.28 and spec.defaults["aggregation"] == "token-mean"
    with pytest.raises(TypeError):
        spec.defaults["eps_high"] = 0.3
    batch = make_batch()
    advantages = spec.advantages(batch["rewards"], batch["group_ids"], batch["mask"].sum(-1))
    norm = global_norm(batch["mask"], batch["rewards"], max_new_tokens=8)
    inputs = inputs_for(batch, batch["policy"], advantages)
    implicit, _ = spec.objective(inputs, norm)
    explicit, _ = LOSSES["grpo"].objective(inputs, norm, eps_high=0.28, aggregation="token-mean")
    torch.testing.assert_close(implicit, explicit, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_unknown_option_raises_value_error_naming_it(name):
    batch = make_batch()
    advantages = LOSSES[name].advantages(batch["rewards"], batch["group_ids"], batch["mask"].sum(-1))
    norm = global_norm(batch["mask"], batch["rewards"], max_new_tokens=8)
    with pytest.raises(ValueError, match="epsilon_low"):
        LOSSES[name].objective(inputs_for(batch, batch["policy"], advantages), norm, epsilon_low=0.1)


@pytest.mark.parametrize("name,option", [
    ("grpo", {"eps_low": 1.5}), ("grpo", {"aggregation": "mean"}), ("grpo", {"mismatch": "is"}),
    ("grpo", {"mismatch_cap": 0.0}), ("grpo", {"icepop_band": (2.0, 1.0)}), ("grpo", {"icepop_weight": "hard"}),
    ("gspo", {"eps_high": -0.1}), ("misc", {"misc_impl": "sequence"}), ("misc", {"modality_bands": {"x": (1, 2)}}),
    ("flashreinforce", {"delta": -1.0}), ("flashreinforce", {"negative_token_fraction": 2.0}),
])
def test_bad_option_values_raise_value_error(name, option):
    batch = make_batch()
    advantages = LOSSES[name].advantages(batch["rewards"], batch["group_ids"], batch["mask"].sum(-1))
    norm = global_norm(batch["mask"], batch["rewards"], max_new_tokens=8)
    with pytest.raises(ValueError, match=next(iter(option)).split("_")[0]):
        LOSSES[name].objective(inputs_for(batch, batch["policy"], advantages), norm, **option)


def test_the_config_knows_every_loss_by_name():
    from flashreinforce.config import LOSS_NAMES

    assert LOSS_NAMES == tuple(LOSSES)


@pytest.mark.parametrize(("loss", "options", "message"), [
    ("misc", {"baseline": "task"}, r"unknown option\(s\) \['baseline'\] for loss 'misc'"),
    ("misc", {"eps_low": -1}, "eps_low=-1"),
    ("flashreinforce", {"baseline": "prompt"}, "baseline='prompt'"),
    ("grpo", {"mismatch": "sometimes"}, "mismatch"),
])
def test_check_options_names_an_unknown_option_or_a_bad_value_before_any_work(loss, options, message):
    with pytest.raises(ValueError, match=message):
        LOSSES[loss].check_options(options, loss)
    LOSSES[loss].check_options({}, loss)  # the defaults are valid
