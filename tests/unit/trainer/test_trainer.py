import copy
import dataclasses
import math
from itertools import pairwise

import pytest
import torch

from flashreinforce.models import build_model, token_logprobs
from flashreinforce.trainer.batching import collate
from flashreinforce.trainer.checkpoint import latest_checkpoint, list_checkpoints, load_states, save_checkpoint
from flashreinforce.trainer.optim import lr_multiplier
from flashreinforce.trainer.trainer import OptimizerSettings, OverlongShaping, Trainer, WPSMSettings
from flashreinforce.types import FORCED_VERSION, Prompt, RolloutKey, Trajectory, Verdict

VOCAB = 12


def make_trajectory(tokens, prompt_length, *, reward=1.0, group=0, sample=0, versions=None, logprobs=None):
    n = len(tokens)
    mask = tuple(int(i >= prompt_length) for i in range(n))
    behavior = tuple(logprobs) if logprobs is not None else tuple(-1.0 * m for m in mask)
    return Trajectory(
        key=RolloutKey(f"p{group}", sample),
        prompt=Prompt(id=f"p{group}", prompt="x", ground_truth="1"),
        group=group,
        tokens=tuple(tokens),
        loss_mask=mask,
        behavior_logprobs=behavior,
        policy_versions=tuple(versions) if versions else tuple(0 if m else FORCED_VERSION for m in mask),
        prompt_length=prompt_length,
        finish_reason="stop",
        verdict=Verdict(reward=reward, passed=reward > 0),
    )


def test_collate_pads_right_and_keeps_columns_aligned():
    batch = collate([make_trajectory([5, 6, 7, 8], 2), make_trajectory([9, 4], 1, group=1)], pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [9, 4, 0, 0]]
    assert batch.attention_mask.int().tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch.loss_mask.int().tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert batch.behavior_logprobs.tolist() == [[0, 0, -1, -1], [0, -1, 0, 0]]
    assert batch.group_ids.tolist() == [0, 1]
    trimmed = batch.rows(1, 2)
    assert trimmed.input_ids.tolist() == [[9, 4]]


def test_microbatches_cap_rows_and_pack_a_token_budget():
    lengths = [2, 3, 3, 4, 9]
    batch = collate([make_trajectory(list(range(1, n + 1)), 1, group=i) for i, n in enumerate(lengths)], 0)

    def shapes(size, budget=None):
        return [(start, tuple(m.input_ids.shape)) for start, m in batch.microbatches(size, budget)]

    assert shapes(2) == [(0, (2, 3)), (2, (2, 4)), (4, (1, 9))]  # each slice trimmed to its longest row
    # budget 9: [2 3 3] is 3 x 3 = 9 cells, adding 4 would be 16; [4] then [9]: a row over budget goes alone
    assert shapes(8, budget=9) == [(0, (3, 3)), (3, (1, 4)), (4, (1, 9))]
    assert shapes(2, budget=100) == shapes(2)  # the row cap still holds under a loose budget


def test_collate_refuses_a_row_without_policy_tokens():
    with pytest.raises(ValueError, match="no sampled tokens"):
        collate([make_trajectory([5, 6], 2)], pad_token_id=0)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    schedule = [lr_multiplier(s, warmup_steps=2, total_steps=10, min_lr_ratio=0.1) for s in range(12)]
    assert schedule[:2] == [0.5, 1.0]
    assert schedule[2] == pytest.approx(1.0)
    assert schedule[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert schedule[10] == pytest.approx(0.1) and schedule[11] == pytest.approx(0.1)
    assert all(a >= b for a, b in pairwise(schedule[1:]))


def _on_policy_batch(model, rows, group_size):
    """Random sequences whose behavior log-probs are the model's own (ratio 1, trust region admits)."""
    generator = torch.Generator().manual_seed(0)
    trajectories = []
    for row in range(rows):
        length = 4 + row % 5
        tokens = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        with torch.no_grad():
            lp, _ = token_logprobs(model, torch.tensor([tokens]), with_entropy=False)
        trajectories.append(make_trajectory(tokens, 2, reward=float(row % 3 == 0), group=row // group_size,
                                            sample=row % group_size, logprobs=[0, 0, *lp[0, 2:].tolist()]))
    return trajectories


def _two_task_rows(base):
    """8 rows, one per group: task a rewards 0/1, task b 10/11 (every row passes): a's batch-mean advantages are all
    negative, its own-task ones half positive."""
    rows = _on_policy_batch(base, rows=8, group_size=1)
    return [dataclasses.replace(t, prompt=dataclasses.replace(t.prompt, task="a" if i < 4 else "b"),
                                verdict=Verdict(reward=float(i % 2) + (10.0 if i >= 4 else 0.0), passed=True))
            for i, t in enumerate(rows)]


def _trainer(model, loss, microbatch_size, microbatch_tokens=None, loss_options=None, lr=1e-2, **options):
    return Trainer(
        model,
        loss=loss,
        loss_options=loss_options or {},
        optimizer=OptimizerSettings(lr=lr, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=0,
                                    total_steps=10, min_lr_ratio=1.0, grad_clip=1e9),
        microbatch_size=microbatch_size,
        microbatch_tokens=microbatch_tokens,
        pad_token_id=0,
        temperature=1.0,
        max_new_tokens=8,
        **options,
    )


@pytest.mark.parametrize(("loss", "group_size"), [("flashreinforce", 1), ("grpo", 4), ("dapo", 4), ("drgrpo", 4)])
def test_microbatches_give_the_full_batch_step(loss, group_size):
    """Global normalization: 3 uneven microbatches step the weights exactly like one batch."""
    base = build_model(VOCAB, 16, 1, 2, 32, dtype=torch.float64, seed=1)
    batch = _on_policy_batch(base, rows=8, group_size=group_size)
    whole, split = copy.deepcopy(base), copy.deepcopy(base)
    metrics_whole = _trainer(whole, loss, microbatch_size=8).step(batch)
    metrics_split = _trainer(split, loss, microbatch_size=3).step(batch)
    assert metrics_whole["optim/grad_norm"] > 0
    assert metrics_split["optim/grad_norm"] == pytest.approx(metrics_whole["optim/grad_norm"], rel=1e-9)
    for a, b in zip(whole.parameters(), split.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_token_budget_packs_sorted_rows_and_steps_like_one_batch():
    base = build_model(VOCAB, 16, 1, 2, 32, dtype=torch.float64, seed=1)
    batch = _on_policy_batch(base, rows=10, group_size=1)  # lengths 4..8
    whole, packed = copy.deepcopy(base), copy.deepcopy(base)
    metrics_whole = _trainer(whole, "flashreinforce", microbatch_size=10).step(batch)
    metrics_packed = _trainer(packed, "flashreinforce", microbatch_size=10, microbatch_tokens=16).step(batch)
    # sorted lengths 4 4 5 5 6 6 7 7 8 8: slices [4 4 5] (15 cells), [5 6] (12), [6 7] (14), [7 8] (16), [8] (8)
    assert metrics_packed["batch/padding_fraction"] == pytest.approx(1 - 60 / 65)
    assert metrics_whole["batch/padding_fraction"] == pytest.approx(1 - 60 / 80)
    for a, b in zip(whole.parameters(), packed.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_task_baseline_trains_each_task_against_its_own_mean_and_microbatches_still_add_up():
    """algo.options.baseline=task in a mixture whose tasks' rewards differ in scale: each row's advantage is its
    reward minus its task's batch mean, and 3 microbatches step the weights exactly like one batch."""
    base = build_model(VOCAB, 16, 1, 2, 32, dtype=torch.float64, seed=1)
    rows = _two_task_rows(base)
    whole, split = copy.deepcopy(base), copy.deepcopy(base)
    trainer = _trainer(whole, "flashreinforce", microbatch_size=8)
    trainer.loss_options = {**trainer.loss_options, "delta": math.inf}
    trainer.advantage_options = {"baseline": "task"}
    ordered = sorted(rows, key=lambda t: len(t.tokens))
    batch = collate(ordered, 0)
    targets = trainer._targets(batch, ordered, ordered)
    expected = torch.tensor([t.reward - (0.5 if t.prompt.task == "a" else 10.5)
                             for t in sorted(rows, key=lambda t: len(t.tokens))], dtype=targets.advantages.dtype)
    assert torch.allclose(targets.advantages, expected) and targets.norm.per_row_baselines
    metrics = trainer.step(rows)
    assert metrics["advantage/single_row_tasks"] == 0
    # the trainer's own figures per task too: entropy, behavior-policy KL, gate rejections (delta=inf: none)
    assert all(metrics[f"task/{t}/entropy_mean"] > 0 and metrics[f"task/{t}/gate_rejected_fraction"] == 0
               and metrics[f"task/{t}/mismatch_k3_kl"] < 1e-6 for t in ("a", "b"))
    other = _trainer(split, "flashreinforce", microbatch_size=3)
    other.loss_options, other.advantage_options = trainer.loss_options, {"baseline": "task"}
    other.step(rows)
    for a, b in zip(whole.parameters(), split.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    batch_baseline = copy.deepcopy(base)
    plain = _trainer(batch_baseline, "flashreinforce", microbatch_size=8)
    plain.loss_options = trainer.loss_options
    plain.step(rows)  # the batch mean (5.5) instead: every task-a row pushed down, task-b up: another step
    assert any(not torch.equal(a, b) for a, b in zip(whole.parameters(), batch_baseline.parameters()))


def test_wpsm_reads_each_rows_advantage_within_its_task_and_reports_flags_per_task():
    """positive_only under the batch-mean baseline: task a's correct rows (reward 1, batch mean 5.5) would count as
    negative and never be flagged, task b's all positive; within each task half of each task's rows are."""
    base = build_model(VOCAB, 16, 1, 2, 32, dtype=torch.float64, seed=1)
    rows = _two_task_rows(base)
    wpsm = WPSMSettings(tau=-1.0, eta=1e9, alpha=1.0, positive_only=True, rate="group")  # only the sign of A decides
    trainer = _trainer(copy.deepcopy(base), "flashreinforce", microbatch_size=3, wpsm=wpsm)
    ordered = sorted(rows, key=lambda t: len(t.tokens))
    batch = collate(ordered, 0)
    targets = trainer._targets(batch, ordered, ordered)
    by_task = {task: [t.reward for t in sorted(rows, key=lambda t: len(t.tokens)) if t.prompt.task == task]
               for task in "ab"}
    expected = torch.tensor([t.reward - sum(by_task[t.prompt.task]) / 4
                             for t in sorted(rows, key=lambda t: len(t.tokens))], dtype=targets.advantages.dtype)
    assert torch.allclose(targets.wpsm_advantages, expected)
    assert bool((targets.advantages[batch.task_ids == 0] < 0).all())  # the trained ones keep the batch mean
    metrics = trainer.step(rows)
    assert metrics["wpsm/flagged_fraction"] == 0.5
    assert metrics["task/a/wpsm/flagged_fraction"] == 0.5 and metrics["task/b/wpsm/flagged_fraction"] == 0.5


def test_wpsm_with_one_task_uses_the_trained_advantages_and_adds_no_task_metrics():
    base = build_model(VOCAB, 16, 1, 2, 32, dtype=torch.float64, seed=1)
    rows = _on_policy_batch(base, rows=8, group_size=2)
    wpsm = WPSMSettings(tau=-1.0, eta=1e9, alpha=1.0, positive_only=True, rate="group")
    trainer = _trainer(copy.deepcopy(base), "flashreinforce", microbatch_size=8, wpsm=wpsm)
    targets = trainer._targets(collate(rows, 0), rows, rows)
    assert targets.wpsm_advantages is targets.advantages
    metrics = trainer.step(rows)
    assert metrics["wpsm/flagged_fraction"] == 3 / 8  # rows 0, 3, 6 pass: reward 1 above the batch mean 3/8
    assert not [k for k in metrics if k.startswith("task/")]
    without = _trainer(copy.deepcopy(base), "flashreinforce", microbatch_size=8).step(rows)
    assert "wpsm/flagged_fraction" not in without and not [k for k in without if k.startswith("task/")]


def test_gradient_checkpointing_recomputes_each_layer_and_steps_like_the_plain_forward():
    base = build_model(VOCAB, 16, 2, 2, 32, dtype=torch.float64, seed=1)
    batch = _on_policy_batch(base, rows=6, group_size=1)
    calls = []

    class Counted(torch.nn.Module):  # module hooks do not run in the recomputation: count in forward itself
        def __init__(self, inner, model):
            super().__init__()
            self.inner, self.model = inner, [model]

        def forward(self, x):
            calls.append(self.model[0])
            return self.inner(x)

    plain, checkpointed = copy.deepcopy(base), copy.deepcopy(base)
    for model in (plain, checkpointed):
        model.model.layers[0].mlp.act_fn = Counted(model.model.layers[0].mlp.act_fn, model)
    _trainer(plain, "flashreinforce", microbatch_size=6).step(batch)
    _trainer(checkpointed, "flashreinforce", microbatch_size=6, gradient_checkpointing=True).step(batch)
    assert calls.count(checkpointed) == 2 * calls.count(plain)  # the forward, then its recomputation
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradient_checkpointing_is_refused_with_router_replay_on_an_moe_model():
    moe = build_model(VOCAB, 16, 1, 2, 32, seed=1, num_experts=4)
    with pytest.raises(ValueError, match="set trainer.router_replay=false"):
        _trainer(moe, "flashreinforce", microbatch_size=4, gradient_checkpointing=True)
    _trainer(moe, "flashreinforce", microbatch_size=4, gradient_checkpointing=True, router_replay=False)


def test_step_reports_zero_mismatch_lag_and_bumps_the_version():
    model = build_model(VOCAB, 16, 1, 2, 32, seed=2)
    trainer = _trainer(model, "flashreinforce", 4)
    batch = _on_policy_batch(model, rows=6, group_size=1)
    metrics = trainer.step(batch)
    assert trainer.version == 1
    assert metrics["mismatch/abs_logprob_diff"] < 1e-5
    assert metrics["lag/mean"] == 0 and metrics["lag/tokens_at_0"] == metrics["batch/policy_tokens"]
    assert metrics["loss/acceptance_rate"] == pytest.approx(1.0)


def test_unknown_loss_or_option_names_the_choices():
    model = build_model(VOCAB, 16, 1, 2, 32)
    with pytest.raises(ValueError, match="flashreinforce"):
        _trainer(model, "ppo2", 4)
    with pytest.raises(ValueError, match="unknown option"):
        Trainer(model, loss="grpo", loss_options={"epsilon": 0.1}, optimizer=OptimizerSettings(
            lr=1e-3, weight_decay=0, betas=(0.9, 0.99), warmup_steps=0, total_steps=1, min_lr_ratio=1, grad_clip=1),
            microbatch_size=1, pad_token_id=0, temperature=1.0, max_new_tokens=4)


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    def write_model(path):
        path.mkdir()
        (path / "config.json").write_text("{}")

    (tmp_path / "step_000009.tmp123").mkdir()  # a torn write from a killed process
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, write_model=write_model, trainer_state={"version": step},
                        controller_state={"inflight": []}, meta={"wall_seconds": 1.0}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    assert not list(tmp_path.glob("*.tmp*")), "the next save clears torn writes"
    assert latest_checkpoint(tmp_path).name == "step_000003"
    trainer_state, _controller_state, meta = load_states(tmp_path / "step_000003")
    assert trainer_state == {"version": 3} and meta["step"] == 3
    (tmp_path / "step_000003" / "trainer.pt").unlink()
    with pytest.raises(ValueError, match="incomplete"):
        load_states(tmp_path / "step_000003")


def test_overlong_shaping_reads_the_generated_length_not_the_trained_one():
    """april's mask_offpolicy un-trains a resumed row's prefix; DAPO's |y| is still every token after the prompt."""
    model = build_model(VOCAB, 16, 1, 2, 32, seed=3)
    trainer = _trainer(model, "flashreinforce", 4)
    trainer.overlong = OverlongShaping(max_length=10, cache=4)
    long_row = make_trajectory([1, 2, *range(1, 11), *range(1, 11)], 2, group=0)  # 20 generated tokens
    long_row = dataclasses.replace(long_row, loss_mask=(0,) * 17 + (1,) * 5)  # only the last 5 are trained
    short_row = make_trajectory([1, 2, 3, 4, 5, 6], 2, group=1)  # 4 generated, no penalty
    metrics = trainer.step([long_row, short_row])
    assert metrics["reward/mean"] == 1.0
    assert metrics["reward/shaped_mean"] == pytest.approx((1 - 1 + 1 + 0) / 2)  # 20 > L_max = 10: R_len = -1
    assert metrics["response/length_mean"] == 12 and metrics["response/length_max"] == 20


def test_reinforce_pp_whitens_over_loss_tokens_by_default_and_over_rows_when_asked():
    model = build_model(VOCAB, 16, 1, 2, 32, seed=4)
    batch = [make_trajectory([1, 2, *range(1, 9)], 2, reward=1.0, group=0),  # 8 loss tokens
             make_trajectory([1, 2, 3], 2, reward=0.0, group=1),  # 1
             make_trajectory([1, 2, 3, 4], 2, reward=0.0, group=2)]  # 2
    by_tokens = Trainer(copy.deepcopy(model), **_settings("reinforce++", {})).step(batch)
    by_rows = Trainer(copy.deepcopy(model), **_settings("reinforce++", {"whiten": "rows"})).step(batch)
    # tokens: mean 8/11, population std over 11 tokens; rows: mean 1/3, sample std over 3 rows
    mean, var = 8 / 11, (8 * (1 - 8 / 11) ** 2 + 3 * (8 / 11) ** 2) / 11
    expected = [(r - mean) / math.sqrt(var) for r in (1.0, 0.0, 0.0)]
    assert by_tokens["advantage/abs_mean"] == pytest.approx(sum(abs(a) for a in expected) / 3)
    assert by_rows["advantage/abs_mean"] == pytest.approx((2 / 3 + 1 / 3 + 1 / 3) / 3 / math.sqrt(1 / 3), rel=1e-5)
    with pytest.raises(ValueError, match="whiten='columns'"):
        Trainer(copy.deepcopy(model), **_settings("reinforce++", {"whiten": "columns"}))
    with pytest.raises(ValueError, match="unknown option.*whiten"):  # not an option of a loss without whitening
        Trainer(copy.deepcopy(model), **_settings("grpo", {"whiten": "rows"}))


def _settings(loss, options):
    return dict(loss=loss, loss_options=options, optimizer=OptimizerSettings(
        lr=1e-3, weight_decay=0, betas=(0.9, 0.99), warmup_steps=0, total_steps=1, min_lr_ratio=1, grad_clip=1),
        microbatch_size=4, pad_token_id=0, temperature=1.0, max_new_tokens=8)


def test_entropy_kl_and_gate_rejections_are_reported_per_modality():
    """Rows of two modalities in one batch: the trainer's own figures split by modality, and each modality's mean
    entropy is its rows' (a modality the policy starts to ignore shows as its own collapse)."""
    base = build_model(VOCAB, 16, 1, 2, 32, dtype=torch.float64, seed=1)
    rows = [dataclasses.replace(t, prompt=dataclasses.replace(t.prompt, modality="image" if i % 2 else "text"))
            for i, t in enumerate(_on_policy_batch(base, rows=8, group_size=1))]
    metrics = _trainer(copy.deepcopy(base), "flashreinforce", microbatch_size=3).step(rows)
    assert all(metrics[f"modality/{m}/entropy_mean"] > 0 and metrics[f"modality/{m}/mismatch_k3_kl"] < 1e-6
               and 0 <= metrics[f"modality/{m}/gate_rejected_fraction"] <= 1 for m in ("text", "image"))
    assert metrics["modality/text/entropy_mean"] != metrics["modality/image/entropy_mean"]
    one = _trainer(copy.deepcopy(base), "flashreinforce", microbatch_size=3).step(
        [dataclasses.replace(t, prompt=dataclasses.replace(t.prompt, modality="text")) for t in rows])
    assert not any(name.startswith("modality/") for name in one)  # one modality: its totals already say it
    # the token-weighted mean over the modalities is the batch's entropy
    tokens = {m: sum(t.num_policy_tokens for t in rows if t.prompt.modality == m) for m in ("text", "image")}
    mixed = sum(metrics[f"modality/{m}/entropy_mean"] * tokens[m] for m in tokens) / sum(tokens.values())
    assert mixed == pytest.approx(metrics["entropy/mean"], rel=1e-9)


def test_misc_bands_mask_each_modality_by_its_own_band_and_say_so_per_modality():
    """One batch of text and image rows sampled by a slightly different behavior policy: MISC's narrow image band
    masks image tokens while the default band keeps every text token, and modality/<tag>/masked_fraction says
    which modality lost its tokens."""
    base = build_model(VOCAB, 16, 1, 2, 32, dtype=torch.float64, seed=1)
    shift = [0.0, 0.0] + [0.3 * (-1) ** j for j in range(8)]  # rho = e^{-0.3} or e^{+0.3}: in (0.5, 5), not (0.9, 1.1)
    rows = [dataclasses.replace(t, prompt=dataclasses.replace(t.prompt, modality="image" if i % 2 else "text"),
                                behavior_logprobs=tuple(b + s for b, s in zip(t.behavior_logprobs, shift)))
            for i, t in enumerate(_on_policy_batch(base, rows=8, group_size=1))]
    metrics = _trainer(copy.deepcopy(base), "misc", microbatch_size=3,
                       loss_options={"modality_bands": {"image": (0.9, 1.1, 0.05, 0.05)}}).step(rows)
    assert metrics["modality/text/masked_fraction"] == 0.0
    assert metrics["modality/image/masked_fraction"] == 1.0
    tokens = {m: sum(t.num_policy_tokens for t in rows if t.prompt.modality == m) for m in ("text", "image")}
    assert metrics["loss/mismatch/masked_fraction"] == pytest.approx(tokens["image"] / sum(tokens.values()))


def test_a_stage_keeps_adams_moments_under_its_own_lr_and_a_fresh_schedule():
    """A state without a schedule (a stage boundary) carries AdamW's moments, not the old lr or step count."""
    base = build_model(VOCAB, 16, 1, 2, 32, dtype=torch.float64, seed=1)
    batch = _on_policy_batch(base, rows=8, group_size=1)
    first = _trainer(copy.deepcopy(base), "flashreinforce", microbatch_size=8)
    first.step(batch)
    first.step(batch)
    state = {k: v for k, v in first.state_dict().items() if k != "schedule"}
    kept, reset = (_trainer(copy.deepcopy(first.model), "flashreinforce", 8, lr=1e-3) for _ in range(2))
    kept.load_state_dict(state)
    reset.load_state_dict({k: v for k, v in state.items() if k != "optimizer"})
    assert kept.version == reset.version == 2
    moments = [kept.optimizer.state[p]["exp_avg"] for p in kept.optimizer.param_groups[0]["params"]]
    assert moments and all(m.abs().sum() > 0 for m in moments) and not reset.optimizer.state
    assert all(group["lr"] == 1e-3 for group in kept.optimizer.param_groups), "the old stage's lr came back"
    assert kept.step(batch)["optim/lr"] == reset.step(batch)["optim/lr"] == 1e-3
    assert kept.schedule.last_epoch == 1  # the new stage's schedule counts from its own start
    moved = [(a - b).abs().max() for a, b in zip(kept.model.parameters(), reset.model.parameters())]
    assert max(moved) > 0, "carried moments must change the step"


def test_a_stage_after_sft_carries_only_the_step_count():
    trainer = _trainer(build_model(VOCAB, 16, 1, 2, 32, dtype=torch.float64, seed=1), "flashreinforce", 8)
    trainer.load_state_dict({"version": 7})
    assert trainer.version == 7 and not trainer.optimizer.state


def test_each_rows_geometric_mean_mismatch_is_logged_per_modality():
    """Where a sequence-level IcePop band would fall: the rows' geometric-mean rho = exp(mean log(pi_old / mu)),
    as min / p01 / p50 / p99 / max over all rows and over each modality's."""
    base = build_model(VOCAB, 16, 1, 2, 32, dtype=torch.float64, seed=1)
    rows = _on_policy_batch(base, rows=8, group_size=1)
    shifted = []
    for i, t in enumerate(rows):  # image rows' behavior log-probs 0.2 below the policy's: rho = e^0.2 on each token
        gap = 0.2 if i % 2 else 0.0
        behavior = tuple(lp - gap if m else lp for lp, m in zip(t.behavior_logprobs, t.loss_mask))
        shifted.append(dataclasses.replace(t, behavior_logprobs=behavior, prompt=dataclasses.replace(
            t.prompt, modality="image" if i % 2 else "text", task="a")))
    metrics = _trainer(copy.deepcopy(base), "grpo", microbatch_size=3).step(shifted)
    assert metrics["modality/image/seq_ratio_p50"] == pytest.approx(math.exp(0.2), rel=1e-6)
    assert metrics["modality/text/seq_ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["mismatch/seq_ratio_min"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["mismatch/seq_ratio_max"] == pytest.approx(math.exp(0.2), rel=1e-6)
