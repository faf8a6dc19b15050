"""On-policy distillation (algo.loss=opd) against float64 references: hand-made log-probs (advantages, masks, the
KL estimate, clip, mixing, mismatch weights) and the gradient of the reverse KL computed directly by autograd."""

import itertools
import math

import pytest
import torch

from flashreinforce.algorithms import LOSSES, GlobalNorm, LossInputs, sequence_reverse_kl, teacher_signal
from flashreinforce.algorithms.objectives import clip_objective

NAN = float("nan")
MASK = torch.tensor([[False, True, True, True], [False, True, True, False]])
POLICY = [[NAN, -0.5, -1.0, -2.0], [NAN, -0.25, -3.0, NAN]]
TEACHER = [[NAN, -0.1, -2.5, -2.0], [NAN, -1.25, -0.5, NAN]]


def _inputs(policy, teacher, *, behavior=None, advantages=(0.0, 0.0), weights=None, mask=MASK):
    policy = torch.tensor(policy, dtype=torch.float64) if not isinstance(policy, torch.Tensor) else policy
    old = policy.detach()
    return LossInputs(policy_logprobs=policy, old_logprobs=old,
                      behavior_logprobs=old if behavior is None else torch.tensor(behavior, dtype=torch.float64),
                      loss_mask=mask, advantages=torch.tensor(advantages, dtype=torch.float64),
                      rewards=torch.zeros(mask.shape[0], dtype=torch.float64),
                      teacher_logprobs=torch.tensor(teacher, dtype=torch.float64), sequence_weights=weights)


def _norm(mask=MASK, rows=None):
    return GlobalNorm(num_sequences=rows or mask.shape[0], num_tokens=int(mask.sum()), reward_mean=0.0,
                      max_new_tokens=8)


def _opd(inputs, norm=None, **options):
    return LOSSES["opd"].objective(inputs, norm or _norm(inputs.loss_mask), **options)


def test_hand_made_logprobs_give_the_float64_reference_loss_gradient_and_kl():
    """a_ij = teacher - student on the mask: row 0 [0.4, -1.5, 0], row 1 [-1, 2.5]; r = 1, token-mean over 5 tokens:
    loss = -(0.4 - 1.5 + 0 - 1 + 2.5) / 5 = -0.08; d loss / d log pi_ij = -a_ij / 5; the KL estimate per row is minus
    its signal's sum: [1.1, -1.5], per token (1.1 - 1.5) / 5 = -0.08."""
    policy = torch.tensor(POLICY, dtype=torch.float64, requires_grad=True)
    loss, stats = _opd(_inputs(policy, TEACHER))
    assert loss.item() == pytest.approx(-0.08, abs=1e-15)
    loss.backward()
    expected = torch.tensor([[0.0, -0.4, 1.5, 0.0], [0.0, 1.0, -2.5, 0.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(policy.grad, expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(stats["sequence_reverse_kl"], torch.tensor([1.1, -1.5], dtype=torch.float64),
                               rtol=0, atol=1e-15)
    assert stats["reverse_kl"].item() == pytest.approx(-0.08, abs=1e-15)
    signal = teacher_signal(torch.tensor(TEACHER), torch.tensor(POLICY), MASK)
    torch.testing.assert_close(signal, torch.tensor([[0, 0.4, -1.5, 0], [0, -1.0, 2.5, 0]]))
    torch.testing.assert_close(signal.sum(-1), -sequence_reverse_kl(torch.tensor(TEACHER), torch.tensor(POLICY), MASK))


def test_clip_weights_and_the_verifiers_advantage_mix_per_token():
    """kl_clip 1: signals [0.4, -1, 0] and [-1, 1]; A_ij = 2 a_ij + 0.5 A_i with A = [1, -2]; seq-mean-token-mean:
    loss = -((2*(-0.6) + 3*0.5) / 3 + (2*0 + 2*(-1)) / 2) / 2 = 0.45."""
    policy = torch.tensor(POLICY, dtype=torch.float64, requires_grad=True)
    loss, stats = _opd(_inputs(policy, TEACHER, advantages=(1.0, -2.0)), kl_clip=1.0, kl_weight=2.0,
                       reward_weight=0.5, aggregation="seq-mean-token-mean")
    assert loss.item() == pytest.approx(0.45, abs=1e-15)
    loss.backward()
    advantages = torch.tensor([[0, 2 * 0.4 + 0.5, -2 + 0.5, 0 + 0.5], [0, -2 - 1, 2 - 1, 0]], dtype=torch.float64)
    torch.testing.assert_close(policy.grad, -advantages / torch.tensor([[3.0], [2.0]], dtype=torch.float64) / 2,
                               rtol=0, atol=1e-15)
    # the KL estimate is the unclipped one
    torch.testing.assert_close(stats["sequence_reverse_kl"], torch.tensor([1.1, -1.5], dtype=torch.float64))


def test_the_students_mismatch_weights_apply_to_the_teachers_signal():
    """icepop [0.5, 2]: row 0's second token has rho = exp(-1) < 0.5 and loses its gradient (and only it); tis cap 1.5:
    a token with rho = e^0.2 keeps weight e^0.2 on its signal."""
    behavior = [[NAN, -0.5, 0.0, -2.2], [NAN, -0.25, -3.0, NAN]]
    policy = torch.tensor(POLICY, dtype=torch.float64, requires_grad=True)
    loss, stats = _opd(_inputs(policy, TEACHER, behavior=behavior), mismatch="icepop", icepop_band=(0.5, 2.0))
    loss.backward()
    signal = torch.tensor([[0, 0.4, 0.0, 0.0 * math.exp(0.2)], [0, -1.0, 2.5, 0]], dtype=torch.float64)
    torch.testing.assert_close(policy.grad, -signal / 5, rtol=0, atol=1e-15)  # rho = e^0.2 token: signal 0 anyway
    assert stats["mismatch/masked_fraction"].item() == pytest.approx(1 / 5)
    policy = torch.tensor(POLICY, dtype=torch.float64, requires_grad=True)
    teacher = [[NAN, -0.1, -2.5, -1.0], [NAN, -1.25, -0.5, NAN]]  # the e^0.2 token now has signal 1
    loss, _ = _opd(_inputs(policy, teacher, behavior=behavior), mismatch="tis", mismatch_cap=1.5)
    loss.backward()
    assert policy.grad[0, 3].item() == pytest.approx(-math.exp(0.2) / 5, abs=1e-15)
    assert policy.grad[0, 2].item() == pytest.approx(1.5 * math.exp(-1.0) / 5, abs=1e-15)


def test_a_teacher_equal_to_the_student_gives_no_gradient():
    policy = torch.tensor(POLICY, dtype=torch.float64, requires_grad=True)
    loss, stats = _opd(_inputs(policy, POLICY))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(policy.grad, torch.zeros_like(policy))
    assert stats["reverse_kl"].item() == 0.0


def test_reward_alone_is_the_ppo_clip_loss_on_the_outcome_advantage():
    policy = torch.tensor(POLICY, dtype=torch.float64, requires_grad=True)
    inputs = _inputs(policy, TEACHER, advantages=(0.75, -0.25))
    loss, _ = _opd(inputs, kl_weight=0.0, reward_weight=1.0)
    clip_options = {k: v for k, v in LOSSES["opd"].defaults.items()
                    if k not in ("kl_weight", "reward_weight", "kl_clip")}
    reference, _ = clip_objective(inputs, _norm(), **clip_options)
    assert loss.item() == pytest.approx(reference.item(), abs=1e-15)


def test_the_gradient_is_the_direct_reverse_kl_gradient_over_every_continuation():
    """A two-token response from a bigram student p(y_j | y_j-1) = softmax(W[y_j-1]) and teacher softmax(U[y_j-1]):
    every (y1, y2) is a row, weighted by its probability under the student (sequence_weights). The OPD gradient is then
    exactly the gradient of the per-position reverse KL at every context the student reaches,
    KL_1 + sum_y1 sg[p(y1)] KL_2(y1), computed directly from the full distributions by autograd (float64)."""
    vocab, prompt = 4, 0
    g = torch.Generator().manual_seed(3)
    student = torch.randn(vocab, vocab, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(vocab, vocab, generator=g, dtype=torch.float64)
    pairs = list(itertools.product(range(vocab), repeat=2))
    log_s, log_t = student.log_softmax(-1), teacher.log_softmax(-1)
    rows = torch.stack([torch.stack([log_s[prompt, 0] * 0, log_s[prompt, a], log_s[a, b]]) for a, b in pairs])
    teacher_rows = torch.stack([torch.stack([log_t[prompt, 0] * 0, log_t[prompt, a], log_t[a, b]]) for a, b in pairs])
    mask = torch.tensor([[False, True, True]] * len(pairs))
    weights = torch.stack([log_s[prompt, a] + log_s[a, b] for a, b in pairs]).detach().exp()
    inputs = LossInputs(policy_logprobs=rows, old_logprobs=rows.detach(), behavior_logprobs=rows.detach(),
                        loss_mask=mask, advantages=torch.zeros(len(pairs), dtype=torch.float64),
                        rewards=torch.zeros(len(pairs), dtype=torch.float64), teacher_logprobs=teacher_rows,
                        sequence_weights=weights)
    loss, _ = _opd(inputs, _norm(mask))
    (opd_grad,) = torch.autograd.grad(loss, student, retain_graph=True)

    def kl(row: int) -> torch.Tensor:  # KL(p_S(. | row) || p_T(. | row)) from the full distributions
        return (log_s[row].exp() * (log_s[row] - log_t[row])).sum()
    first = log_s[prompt].exp().detach()
    reverse_kl = kl(prompt) + sum(first[a] * kl(a) for a in range(vocab))
    (direct,) = torch.autograd.grad(reverse_kl / int(mask.sum()), student)
    torch.testing.assert_close(opd_grad, direct, rtol=0, atol=1e-14)
    assert direct.abs().max() > 1e-3


def test_on_a_fixed_batch_the_gradient_is_autograd_of_the_token_level_reverse_kl_estimate():
    """On sampled rows (no enumeration), with r = 1 and no correction: the gradient of the estimate
    sum_ij (log pi_S - log pi_T)^2 / 2 over the same aggregation (its score-function form, float64)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.arange(7)[None, :] < torch.tensor([7, 3, 5, 2])[:, None]
    mask[:, 0] = False
    policy = (-torch.rand(4, 7, generator=g, dtype=torch.float64) * 3).requires_grad_()
    teacher = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 3
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        inputs = LossInputs(policy_logprobs=policy, old_logprobs=policy.detach(), behavior_logprobs=policy.detach(),
                            loss_mask=mask, advantages=torch.zeros(4, dtype=torch.float64),
                            rewards=torch.zeros(4, dtype=torch.float64), teacher_logprobs=teacher)
        (grad,) = torch.autograd.grad(_opd(inputs, _norm(mask), aggregation=aggregation)[0], policy)
        estimate = torch.where(mask, (policy - teacher) ** 2 / 2, 0.0)
        reference = estimate.sum() / mask.sum() if aggregation == "token-mean" else \
            (estimate.sum(-1) / mask.sum(-1)).sum() / 4
        (direct,) = torch.autograd.grad(reference, policy)
        torch.testing.assert_close(grad, direct, rtol=0, atol=1e-15)


def test_off_mask_values_never_reach_the_loss():
    """NaN teacher values off the mask are fine; a NaN or positive one on a loss token is refused, naming it."""
    policy = torch.tensor(POLICY, dtype=torch.float64, requires_grad=True)
    loss, _ = _opd(_inputs(policy, TEACHER))
    loss.backward()
    assert torch.isfinite(policy.grad).all()
    with pytest.raises(ValueError, match=r"teacher_logprobs\[1, 2\]"):
        _inputs(POLICY, [[NAN, -0.1, -2.5, -2.0], [NAN, -1.25, NAN, NAN]])
    with pytest.raises(ValueError, match="teacher_logprobs has shape"):
        _inputs(POLICY, [[-1.0, -1.0]])


def test_missing_teacher_and_bad_options_are_refused_naming_them():
    inputs = LossInputs(policy_logprobs=torch.tensor(POLICY), old_logprobs=torch.tensor(POLICY),
                        behavior_logprobs=torch.tensor(POLICY), loss_mask=MASK, advantages=torch.zeros(2),
                        rewards=torch.zeros(2))
    with pytest.raises(ValueError, match="teacher"):
        _opd(inputs)
    spec = LOSSES["opd"]
    assert spec.needs_teacher and not any(s.needs_teacher for name, s in LOSSES.items() if name != "opd")
    for options, words in (({"kl_weight": 0.0}, "both 0"), ({"reward_weight": -1}, "reward_weight"),
                           ({"kl_clip": 0}, "kl_clip"), ({"kl_clip": "x"}, "kl_clip"), ({"kl_wieght": 1}, "kl_weight")):
        with pytest.raises(ValueError, match=words):
            spec.check_options(options, "opd")
    spec.check_options({"baseline": "task", "reward_weight": 1.0, "kl_clip": 5.0, "mismatch": "icepop"}, "opd")
