"""A learner batch trained as N optimizer steps (trainer.minibatches): whole groups per part; each part's gradient is
what a separate step over its rows gives, against theta_old and the whole batch's advantages; the clip ranges act;
WPSM's per-query rates (ERNIE eq. 4) counted across steps and kept in the trainer's state."""

import copy
import dataclasses

import pytest
import torch

from flashreinforce.algorithms import LOSSES, GlobalNorm, LossInputs
from flashreinforce.models import build_model, token_logprobs
from flashreinforce.trainer.batching import collate
from flashreinforce.trainer.minibatches import minibatch_rows
from flashreinforce.trainer.trainer import WPSMSettings
from flashreinforce.types import Verdict
from test_trainer import VOCAB, _on_policy_batch, _trainer


def test_parts_hold_whole_groups_in_batch_order():
    groups = torch.tensor([3, 3, 1, 2, 1, 2, 7, 7])
    parts = minibatch_rows(groups, 2)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 4], [3, 5, 6, 7]]  # groups 3, 1 | 2, 7
    assert [p.tolist() for p in minibatch_rows(groups, 3)] == [[0, 1], [2, 3, 4, 5], [6, 7]]  # 4 groups: 1, 2, 1
    assert [p.tolist() for p in minibatch_rows(groups, 9)] == [[0, 1], [2, 4], [3, 5], [6, 7]]  # one group a part
    assert [p.tolist() for p in minibatch_rows(groups, 1)] == [list(range(8))]
    with pytest.raises(ValueError, match="minibatches"):
        minibatch_rows(groups, 0)


def _recording(trainer):
    """The gradient each optimizer step applied, and the weights it started from."""
    steps = []
    step = trainer.optimizer.step

    def recorded(*args, **kwargs):
        steps.append(([p.detach().clone() for p in trainer.model.parameters()],
                      [p.grad.detach().clone() for p in trainer.model.parameters()]))
        return step(*args, **kwargs)
    trainer.optimizer.step = recorded
    return steps


def _separate_step_gradient(model, weights, rows, ordered, parts_rows, theta_old, loss, advantages):
    """The gradient a step over `rows` alone gives at `weights`: the loss's own objective against theta_old's
    log-probs, the whole batch's advantages, normalized over these rows (float64)."""
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    model.zero_grad()
    batch = collate([ordered[i] for i in rows], 0)
    logprobs, entropies = token_logprobs(model, batch.input_ids, batch.attention_mask)
    with torch.no_grad():
        old, _ = token_logprobs(theta_old, batch.input_ids, batch.attention_mask)
    inputs = LossInputs(policy_logprobs=logprobs, old_logprobs=old, behavior_logprobs=batch.behavior_logprobs,
                        loss_mask=batch.loss_mask, advantages=advantages[rows], rewards=batch.rewards,
                        entropies=entropies.detach(), failures=batch.failures, modalities=batch.modalities)
    norm = GlobalNorm(num_sequences=len(rows), num_tokens=int(batch.loss_mask.sum()),
                      reward_mean=float(collate(ordered, 0).rewards.mean()), max_new_tokens=8)
    value, _ = LOSSES[loss].objective(inputs, norm, **LOSSES[loss].defaults)
    value.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")  # the recording
@pytest.mark.parametrize("loss", ["grpo", "gspo", "misc"])
def test_each_minibatch_steps_as_a_separate_step_against_theta_old_and_the_whole_batchs_advantages(loss):
    base = build_model(VOCAB, 16, 1, 2, 32, dtype=torch.float64, seed=1)
    rollouts = _on_policy_batch(base, rows=12, group_size=3)
    trainer = _trainer(copy.deepcopy(base), loss, microbatch_size=2, lr=5e-2, minibatches=2)
    steps = _recording(trainer)
    metrics = trainer.step(rollouts)
    assert len(steps) == 2 and trainer.version == 1 and metrics["optim/minibatches"] == 2
    ordered = sorted(rollouts, key=lambda t: len(t.tokens))
    batch = collate(ordered, 0)
    advantages = LOSSES[loss].advantages(batch.rewards, batch.group_ids, batch.loss_mask.sum(1))
    parts = minibatch_rows(batch.group_ids, 2)
    reference = copy.deepcopy(base)
    for (weights, applied), rows in zip(steps, parts):
        expected = _separate_step_gradient(reference, weights, rows, ordered, parts, base, loss, advantages)
        for got, want in zip(applied, expected):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert any(not torch.equal(a, b) for a, b in zip(steps[0][0], steps[1][0]))  # the first step moved them


def test_the_sequence_clip_acts_from_the_second_minibatch_and_never_with_one():
    """GSPO's clip ranges (3e-4, 4e-4) against theta_old: with one step per batch every ratio is 1 and nothing is
    clipped; the second of two steps sees the first's drift."""
    base = build_model(VOCAB, 16, 1, 2, 32, dtype=torch.float64, seed=1)
    rollouts = _on_policy_batch(base, rows=12, group_size=3)
    one = _trainer(copy.deepcopy(base), "gspo", microbatch_size=4, lr=1e-2).step(rollouts)
    two = _trainer(copy.deepcopy(base), "gspo", microbatch_size=4, lr=1e-2, minibatches=2).step(rollouts)
    assert one["loss/clip_fraction"] == 0.0
    assert two["loss/clip_fraction"] > 0.0


def test_one_minibatch_is_exactly_todays_step():
    base = build_model(VOCAB, 16, 1, 2, 32, dtype=torch.float64, seed=1)
    rollouts = _on_policy_batch(base, rows=8, group_size=2)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    _trainer(a, "grpo", microbatch_size=3).step(rollouts)
    _trainer(b, "grpo", microbatch_size=3, minibatches=1).step(rollouts)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_wpsm_query_rates_count_every_rollout_across_steps_and_resume_exactly():
    """Eq. 4 with one rollout a prompt: a prompt's first result is no rate (nothing flagged); from its second
    rollout on its rate is every result so far, right and wrong answers of a well-learned prompt alike are flagged,
    and a trainer restored from the state flags exactly what the uninterrupted one does."""
    base = build_model(VOCAB, 16, 1, 2, 32, dtype=torch.float64, seed=1)
    rows = _on_policy_batch(base, rows=6, group_size=1)  # prompts p0..p5, one rollout each
    wpsm = WPSMSettings(tau=0.5, eta=1e9, alpha=1.0)
    trainer = _trainer(copy.deepcopy(base), "flashreinforce", microbatch_size=8, wpsm=wpsm)
    first = trainer.step(rows)
    assert first["wpsm/flagged_fraction"] == 0.0  # one result a prompt: no rate yet
    passed = [dataclasses.replace(t, verdict=Verdict(reward=1.0, passed=True)) for t in rows]
    state = copy.deepcopy(trainer.state_dict())
    second = trainer.step(passed)
    # rates now: p0, p3 (passed twice) 1.0 > 0.5 -> flagged; the rest 1/2, not > 0.5
    assert second["wpsm/flagged_fraction"] == pytest.approx(2 / 6)
    assert state["wpsm_queries"] == {f"p{i}": [int(i % 3 == 0), 1] for i in range(6)}
    resumed = _trainer(copy.deepcopy(base), "flashreinforce", microbatch_size=8, wpsm=wpsm)
    resumed.load_state_dict(state)
    assert resumed.step(passed)["wpsm/flagged_fraction"] == second["wpsm/flagged_fraction"]
    assert resumed.query_success.state_dict() == trainer.query_success.state_dict()
    wrong = [dataclasses.replace(t, verdict=Verdict(reward=0.0, passed=False)) for t in rows]
    third = trainer.step(wrong)  # p0, p3: 2 of 3 > 0.5, flagged though this answer is wrong (eq. 4)
    assert third["wpsm/flagged_fraction"] == pytest.approx(2 / 6)
    group = _trainer(copy.deepcopy(base), "flashreinforce", microbatch_size=8,
                     wpsm=dataclasses.replace(wpsm, rate="group", min_rollouts=1))
    assert group.step(passed)["wpsm/flagged_fraction"] == 1.0  # the current group alone: every right row
