"""FlashREINFORCE loss: ALGORITHMS.md section 6 properties, the analytic gradient, slices, the entropy filter."""

import math

import pytest
import torch

from flashreinforce import flashreinforce_loss
from flashreinforce.algorithms.flashreinforce import _kth_lowest, keep_highest

FULL = torch.ones(2, 2, dtype=torch.bool)


def analytic_gradient(current, behavior, rewards, mask, *, delta, fraction=1.0, entropies=None, failures=None):
    """Section 6 written out with Python floats, one token at a time: the independent check."""
    batch, width = mask.shape
    advantages = [r - sum(rewards.tolist()) / batch for r in rewards.tolist()]
    grad = torch.zeros(batch, width, dtype=torch.float64)
    clamp = lambda v: min(max(v, 1e-6), 1 - 1e-6)  # noqa: E731
    for i in range(batch):
        tokens = [t for t in range(width) if mask[i, t]]
        kl = 0.0
        for t in tokens:
            p, q = clamp(math.exp(behavior[i, t])), clamp(math.exp(current[i, t]))
            kl += p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
        if max(kl / len(tokens), 0.0) > delta:
            continue
        kept = tokens
        if fraction < 1 and failures[i]:
            by_entropy = sorted(tokens, key=lambda t: (-float(entropies[i, t]), t))
            kept = by_entropy[: math.ceil(fraction * len(tokens))]
        for t in kept:
            ratio = math.exp(float(current[i, t]) - float(behavior[i, t]))
            grad[i, t] = -advantages[i] * ratio / len(tokens) / batch
    return grad


def random_batch(seed=0, batch=6, width=7):
    """Unequal lengths, tied entropies, behavior drifting by row so that some rows are rejected."""
    g = torch.Generator().manual_seed(seed)
    current = -torch.rand(batch, width, generator=g, dtype=torch.float64) * 3 - 0.05
    drift = torch.linspace(0.0, 0.6, batch, dtype=torch.float64)[:, None]
    behavior = (current + drift * torch.randn(batch, width, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    lengths = torch.tensor([7, 1, 4, 6, 3, 5])[:batch]
    mask = torch.arange(width)[None, :] < lengths[:, None]
    mask[2] = torch.tensor([False, True, True, False, True, True, False])  # a gap, as in multi-turn rows
    rewards = torch.randint(0, 3, (batch,), generator=g).to(torch.float64)
    entropies = torch.randint(0, 3, (batch, width), generator=g).to(torch.float64)  # many ties
    failures = torch.tensor([True, False, True, True, False, True])[:batch]
    current[~mask] = float("nan")
    behavior[~mask] = float("inf")
    entropies[~mask] = float("nan")
    return current, behavior, rewards, mask, entropies, failures


def test_full_gradient_matches_analytic_formula_with_rejections_filter_and_unequal_lengths():
    current, behavior, rewards, mask, entropies, failures = random_batch()
    _, probe = flashreinforce_loss(current, behavior, rewards, mask, delta=math.inf)
    kls = probe["sequence_kl"].sort().values
    delta = float(kls[2] + kls[3]) / 2  # admits exactly half the rows
    live = current.clone().requires_grad_()
    loss, stats = flashreinforce_loss(live, behavior, rewards, mask, delta=delta, negative_token_fraction=0.5,
                                      entropies=entropies, failures=failures)
    loss.backward()
    expected = analytic_gradient(current, behavior, rewards, mask, delta=delta, fraction=0.5, entropies=entropies,
                                 failures=failures)
    assert stats["admitted"].sum() == 3
    assert stats["retained_tokens"][~stats["admitted"]].eq(0).all()
    torch.testing.assert_close(live.grad, expected, rtol=0, atol=1e-8)
    # the loss is linear in log_probs with the gradient as coefficient
    torch.testing.assert_close(loss, (expected * torch.where(mask, current, 0.0)).sum(), rtol=0, atol=1e-8)


def test_gradient_is_detached_ratio_times_advantage_when_everything_admitted():
    current = torch.tensor([[-1.0, -2.0, -3.0], [-2.0, -1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    behavior = (current.detach() - 0.1).requires_grad_()
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    loss, stats = flashreinforce_loss(current, behavior, rewards, mask, delta=math.inf)
    loss.backward()
    # A = [0.5, -0.5]; row 0: -0.5 e^0.1 / 1 / 2; row 1: +0.5 e^0.1 / 3 / 2 per token
    e = math.exp(0.1)
    expected = torch.tensor([[-0.25 * e, 0, 0], [e / 12, e / 12, e / 12]], dtype=torch.float64)
    torch.testing.assert_close(current.grad, expected, rtol=0, atol=1e-12)
    assert behavior.grad is None and rewards.grad is None
    assert not any(value.requires_grad for value in stats.values())


def test_rejected_row_gets_zero_gradient_but_stays_in_the_batch_denominator():
    current = torch.full((2, 2), -1.0, requires_grad=True)
    behavior = torch.tensor([[-4.0, -1.0], [-1.0, -1.0]])
    loss, stats = flashreinforce_loss(current, behavior, torch.tensor([1.0, 0.0]), FULL)
    loss.backward()
    assert stats["admitted"].tolist() == [False, True]
    assert stats["acceptance_rate"].item() == 0.5
    # row 1: -A/T/B = 0.5 / 2 / 2 = 0.125 (B = 2 although only one row is admitted)
    torch.testing.assert_close(current.grad, torch.tensor([[0.0, 0.0], [0.125, 0.125]]))


def test_bernoulli_kl_value_and_inclusive_boundary():
    p, q = 0.2, 0.4
    current = torch.full((2, 1), math.log(q), dtype=torch.float64)
    behavior = torch.full_like(current, math.log(p))  # behavior || current, not the reverse
    args = (current, behavior, torch.tensor([1.0, 0.0]), torch.ones(2, 1, dtype=torch.bool))
    _, stats = flashreinforce_loss(*args, delta=math.inf)
    expected = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))  # 0.0915...
    assert stats["sequence_kl"][0].item() == pytest.approx(expected, rel=1e-12)
    _, boundary = flashreinforce_loss(*args, delta=stats["sequence_kl"][0].item())
    assert boundary["admitted"].all()
    _, below = flashreinforce_loss(*args, delta=stats["sequence_kl"][0].item() * (1 - 1e-9))
    assert not below["admitted"].any()


def test_probabilities_are_clamped_before_the_kl():
    # log p = -50 and -60 both clamp to 1e-6: the gate sees identical coins, KL exactly 0
    current = torch.tensor([[-50.0]], dtype=torch.float64)
    behavior = torch.tensor([[-60.0]], dtype=torch.float64)
    _, stats = flashreinforce_loss(current, behavior, torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool),
                                   delta=0.0)
    assert stats["sequence_kl"].item() == 0.0 and stats["admitted"].all()


@pytest.mark.parametrize("all_rejected", [False, True])
def test_constant_rewards_or_all_rejected_give_zero_loss_and_gradient(all_rejected):
    current = torch.full((2, 3), -1.0, requires_grad=True)
    behavior = torch.full((2, 3), -4.0 if all_rejected else -1.0)
    rewards = torch.tensor([1.0, 0.0] if all_rejected else [1.0, 1.0])
    loss, _ = flashreinforce_loss(current, behavior, rewards, torch.ones(2, 3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0 and current.grad.eq(0).all()


def test_masked_nan_and_inf_do_not_contaminate_loss_or_gradient():
    current = torch.tensor([[-1.0, float("nan")], [-1.0, float("inf")]], requires_grad=True)
    behavior = torch.tensor([[-1.0, float("inf")], [-1.0, float("nan")]])
    mask = torch.tensor([[True, False], [True, False]])
    loss, _ = flashreinforce_loss(current, behavior, torch.tensor([1.0, 0.0]), mask)
    loss.backward()
    assert torch.isfinite(loss)
    torch.testing.assert_close(current.grad, torch.tensor([[-0.25, 0.0], [0.25, 0.0]]))


@pytest.mark.parametrize("fraction,kept", [(0.0, 0), (0.2, 1), (0.9, 3), (1.0, 3)])
def test_entropy_filter_keeps_ceil_fraction_and_the_original_length(fraction, kept):
    current = torch.full((2, 4), -1.0, requires_grad=True)
    mask = torch.tensor([[True, True, True, False], [True, True, True, False]])
    entropies = torch.tensor([[1.0, 2.0, 3.0, 99.0], [1.0, 2.0, 3.0, 99.0]])  # 99 is padding: never kept
    loss, stats = flashreinforce_loss(current, current.detach(), torch.tensor([1.0, 0.0]), mask,
                                      negative_token_fraction=fraction, failures=torch.tensor([False, True]),
                                      entropies=entropies)
    loss.backward()
    assert stats["retained_tokens"].tolist() == [3, kept]
    assert stats["policy_tokens"].tolist() == [3, 3]
    # the failed row keeps its highest-entropy tokens (position 2, then 1, then 0), each -A/T/B = 0.5/3/2
    expected_failed = [1 / 12 if kept >= 3 else 0.0, 1 / 12 if kept >= 2 else 0.0, 1 / 12 if kept >= 1 else 0.0, 0.0]
    torch.testing.assert_close(current.grad[1], torch.tensor(expected_failed))
    torch.testing.assert_close(current.grad[0], torch.tensor([-1 / 12, -1 / 12, -1 / 12, 0.0]))


def test_entropy_filter_uses_explicit_failures_not_the_advantage_sign():
    current = torch.full((2, 2), -1.0, requires_grad=True)
    loss, stats = flashreinforce_loss(current, current.detach(), torch.tensor([1.0, 2.0]), FULL,
                                      negative_token_fraction=0.0, failures=torch.tensor([False, True]),
                                      entropies=torch.ones(2, 2))
    loss.backward()
    assert stats["advantages"].tolist() == [-0.5, 0.5]
    assert stats["retained_tokens"].tolist() == [2, 0]  # the negative-advantage row is not "failed"
    assert current.grad[0].ne(0).all() and current.grad[1].eq(0).all()


def test_entropy_filter_breaks_ties_toward_the_earlier_position():
    current = torch.full((1, 5), -1.0, requires_grad=True)
    entropies = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0]])
    loss, _stats = flashreinforce_loss(current, current.detach(), torch.tensor([1.0]), torch.ones(1, 5, dtype=bool),
                                       negative_token_fraction=0.4, failures=torch.tensor([True]),
                                       entropies=entropies, reward_mean=0.0)
    loss.backward()
    # ceil(0.4 * 5) = 2 of the three tied 2.0s: positions 1 and 2, not 4
    assert current.grad[0].ne(0).tolist() == [False, True, True, False, False]


@pytest.mark.parametrize("seed", range(4))
def test_keep_highest_equals_a_stable_descending_sort(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (9, 12), generator=g).float()  # heavy ties
    mask = torch.rand(9, 12, generator=g) < 0.7
    mask[:, 0] = True
    scores[~mask] = float("nan")
    lengths = mask.sum(-1)
    fractions = torch.tensor([0.0, 0.05, 0.2, 0.5, 0.51, 0.8, 0.95, 1.0, 0.3])
    counts = torch.ceil(fractions.double() * lengths).long()
    for rows in (slice(0, 9), slice(0, 3), slice(5, 8)):  # mixes that pick the keep side and the drop side
        got = keep_highest(scores[rows], mask[rows], counts[rows])
        for i, row in enumerate(range(9)[rows]):
            positions = [t for t in range(12) if mask[row, t]]
            order = sorted(positions, key=lambda t: (-float(scores[row, t]), t))
            expected = torch.zeros(12, dtype=torch.bool)
            expected[order[: int(counts[row])]] = True
            assert got[i].tolist() == expected.tolist(), (seed, row)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_kth_lowest_matches_torch_kthvalue(dtype):
    g = torch.Generator().manual_seed(0)
    values = torch.randint(-3, 4, (5, 11), generator=g).to(dtype)
    values[0, :3] = -math.inf
    values[1, 5:] = math.inf
    for k in (1, 4, 11):
        expected = values.kthvalue(k, dim=-1, keepdim=True).values
        got = _kth_lowest(values, k)
        assert got.dtype == dtype and torch.equal(got, expected), k


def test_keep_highest_in_low_precision_keeps_exact_ties():
    scores = torch.tensor([[0.5, 1.0, 1.0, 0.25, 1.0]], dtype=torch.bfloat16)
    kept = keep_highest(scores, torch.ones(1, 5, dtype=torch.bool), torch.tensor([4]))
    assert kept.tolist() == [[True, True, True, False, True]]


def test_sample_mean_makes_a_trajectory_total_gradient_independent_of_its_length():
    totals = []
    for length in (1, 9):
        current = torch.full((2, length), -1.0, requires_grad=True)
        mask = torch.ones(2, length, dtype=torch.bool)
        mask[0, 1:] = False
        loss, _ = flashreinforce_loss(current, current.detach(), torch.tensor([2.0, -1.0]), mask)
        loss.backward()
        totals.append(current.grad.sum(-1))
    torch.testing.assert_close(totals[0], totals[1])
    torch.testing.assert_close(totals[0], torch.tensor([-0.75, 0.75]))


def test_uneven_slices_sum_to_the_full_batch_loss_and_gradient():
    current, behavior, rewards, mask, entropies, failures = random_batch(seed=1)
    kwargs = dict(delta=0.02, negative_token_fraction=0.5)
    full = current.clone().requires_grad_()
    loss, stats = flashreinforce_loss(full, behavior, rewards, mask, entropies=entropies, failures=failures, **kwargs)
    loss.backward()
    sliced = current.clone().requires_grad_()
    total, rate = 0.0, 0.0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        part, part_stats = flashreinforce_loss(sliced[rows], behavior[rows], rewards[rows], mask[rows],
                                               entropies=entropies[rows], failures=failures[rows],
                                               reward_mean=float(rewards.mean()), num_sequences=6, **kwargs)
        part.backward()
        total, rate = total + part, rate + part_stats["acceptance_rate"]
    assert 0 < stats["admitted"].sum() < 6
    torch.testing.assert_close(total, loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(sliced.grad, full.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(rate, stats["acceptance_rate"])


def test_sequence_weights_scale_each_row():
    current = torch.full((2, 2), -1.0, requires_grad=True)
    loss, _ = flashreinforce_loss(current, current.detach(), torch.tensor([1.0, 0.0]), FULL,
                                  sequence_weights=torch.tensor([0.25, 1.0]))
    loss.backward()
    torch.testing.assert_close(current.grad, torch.tensor([[-0.03125, -0.03125], [0.125, 0.125]]))


def test_bfloat16_is_promoted_to_float32():
    current = torch.zeros(2, 2, dtype=torch.bfloat16, requires_grad=True)
    loss, stats = flashreinforce_loss(current, current.detach(), torch.tensor([1.0, 0.0]), FULL)
    loss.backward()
    assert loss.dtype == torch.float32 and current.grad.dtype == torch.bfloat16
    assert stats["admitted"].all()
    torch.testing.assert_close(current.grad.float(), torch.tensor([[-0.125, -0.125], [0.125, 0.125]]))


def test_overflowing_admitted_ratio_raises_but_a_rejected_one_does_not():
    current = torch.tensor([[-0.5], [-1.0]])
    behavior = torch.tensor([[-100.0], [-1.0]])  # exp(99.5) overflows float32
    args = (current, behavior, torch.tensor([1.0, 0.0]), torch.ones(2, 1, dtype=torch.bool))
    with pytest.raises(FloatingPointError, match="row 0"):
        flashreinforce_loss(*args, delta=math.inf)
    _, stats = flashreinforce_loss(*args)  # the default delta rejects that row before any exp
    assert stats["admitted"].tolist() == [False, True]


@pytest.mark.parametrize("invalid", ["empty_row", "nan", "positive", "behavior_nan", "fraction", "delta",
                                     "delta_nan", "filter", "failures_dtype", "entropy_nan", "num_sequences",
                                     "mask_dtype", "shape"])
def test_invalid_inputs_raise_value_error(invalid):
    current, behavior = torch.full((2, 3), -1.0), torch.full((2, 3), -1.0)
    mask = torch.ones(2, 3, dtype=torch.bool)
    kwargs = {}
    if invalid == "empty_row":
        mask[0] = False
    if invalid == "nan":
        current[0, 0] = float("nan")
    if invalid == "positive":
        current[0, 0] = 0.1
    if invalid == "behavior_nan":
        behavior[1, 2] = float("-inf")
    if invalid == "fraction":
        kwargs["negative_token_fraction"] = 1.1
    if invalid == "delta":
        kwargs["delta"] = -1
    if invalid == "delta_nan":
        kwargs["delta"] = float("nan")
    if invalid == "filter":
        kwargs["negative_token_fraction"] = 0.2
    if invalid == "failures_dtype":
        kwargs.update(negative_token_fraction=0.2, entropies=torch.ones(2, 3), failures=torch.tensor([0, 1]))
    if invalid == "entropy_nan":
        kwargs.update(negative_token_fraction=0.2, entropies=torch.full((2, 3), float("nan")),
                      failures=torch.tensor([False, True]))
    if invalid == "num_sequences":
        kwargs["num_sequences"] = 1
    if invalid == "mask_dtype":
        mask = mask.float()
    if invalid == "shape":
        behavior = behavior[:, :2]
    with pytest.raises(ValueError):
        flashreinforce_loss(current, behavior, torch.tensor([1.0, 0.0]), mask, **kwargs)
