"""bf16 training keeps fp32 master weights and optimizer state, so small updates are not rounded away.

A bf16 weight near 0.02 is a multiple of 2**-13 (1.2e-4): an AdamW step of lr=1e-5 rounds away unless the
optimizer steps an fp32 copy. The reference throughout is the same trainer on an fp32 copy of the model.
"""

import copy

import pytest
import torch

from flashreinforce.models import build_model, token_logprobs
from flashreinforce.models.numerics import Numerics
from flashreinforce.trainer.process import TrainerProcess
from flashreinforce.trainer.sft import sft_warm_start
from flashreinforce.trainer.trainer import OptimizerSettings, Trainer
from flashreinforce.types import FORCED_VERSION, Prompt, RolloutKey, Trajectory, Verdict

VOCAB = 16


def bf16_model(seed: int = 0) -> torch.nn.Module:
    return build_model(VOCAB, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=64,
                       dtype="bfloat16", seed=seed)


def trainer(model: torch.nn.Module, lr: float = 1e-5) -> Trainer:
    """Constant lr, no weight decay, no clipping: AdamW's first step moves each weight by ~lr * sign(grad)."""
    return Trainer(
        model,
        loss="flashreinforce",
        loss_options={},
        optimizer=OptimizerSettings(lr=lr, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=0,
                                    total_steps=10, min_lr_ratio=1.0, grad_clip=1e9),
        microbatch_size=3,
        pad_token_id=0,
        temperature=1.0,
        max_new_tokens=8,
    )


def batch(model: torch.nn.Module, seed: int = 0) -> list[Trajectory]:
    """8 rows of random tokens, rewards 0/1, behavior log-probs the model's own."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for row in range(8):
        tokens = torch.randint(1, VOCAB, (5 + row % 4,), generator=generator).tolist()
        with torch.no_grad():
            logprobs, _ = token_logprobs(model, torch.tensor([tokens]), with_entropy=False)
        mask = tuple(int(i >= 2) for i in range(len(tokens)))
        reward = float(row % 2)
        rows.append(Trajectory(
            key=RolloutKey(f"p{row}", 0), prompt=Prompt(id=f"p{row}", prompt="x", ground_truth="1"), group=row,
            tokens=tuple(tokens), loss_mask=mask, behavior_logprobs=(0.0, 0.0, *logprobs[0, 2:].float().tolist()),
            policy_versions=tuple(0 if m else FORCED_VERSION for m in mask), prompt_length=2,
            finish_reason="stop", verdict=Verdict(reward=reward, passed=reward > 0)))
    return rows


def fraction(flags: list[torch.Tensor]) -> float:
    return float(sum(int(f.sum()) for f in flags)) / sum(f.numel() for f in flags)


def rounded_like_reference(model: torch.nn.Module, reference: torch.nn.Module, initial: dict) -> tuple[float, float]:
    """(share of weights the fp32 reference moved by at least one bf16 step, share of bf16 weights equal to it)."""
    moved, agree = [], []
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        target = ref.detach().to(torch.bfloat16)
        moved.append(target != initial[name])
        agree.append(param.detach() == target)
    return fraction(moved), fraction(agree)


def test_small_updates_to_a_bf16_model_are_not_rounded_away():
    """10 steps of lr=1e-5 add up to ~1e-4: the fp32 reference, rounded to bf16, moves most weights. The bf16
    model must land on the same bf16 numbers (plain AdamW on bf16 weights leaves ~85% of them unchanged)."""
    model = bf16_model()
    reference = copy.deepcopy(model).float()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    rows = batch(reference)
    bf16, fp32 = trainer(model), trainer(reference)
    for _ in range(10):
        bf16.step(rows)
        fp32.step(rows)
    moved, agree = rounded_like_reference(model, reference, initial)
    assert moved > 0.5, "the test needs updates that exceed the bf16 rounding step"
    assert agree > 0.97  # the rest: bf16 vs fp32 forward differences near a rounding boundary
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()), "the model still computes in bf16"


def test_one_step_at_lr_1e_6_moves_every_fp32_master_by_about_lr():
    lr = 1e-6
    model = bf16_model()
    reference = copy.deepcopy(model).float()
    initial = {name: p.detach().float() for name, p in model.named_parameters()}
    rows = batch(reference)
    bf16, fp32 = trainer(model, lr), trainer(reference, lr)
    metrics, expected = bf16.step(rows), fp32.step(rows)
    masters = bf16.state_dict()["master_weights"]
    assert masters.keys() == initial.keys()
    steps, tracks = [], []
    for (name, master), ref in zip(masters.items(), reference.parameters()):
        assert master.dtype == torch.float32
        step = (master - initial[name]).abs()
        steps.append((step > 0.5 * lr) & (step < 1.5 * lr))
        tracks.append((master - ref.detach()).abs() < 0.1 * lr)  # the bf16 step (>= 6e-5 near 0.02) is far coarser
    assert fraction(steps) > 0.99
    assert fraction(tracks) > 0.99  # the rest: weights whose tiny gradient has the other sign in bf16
    assert metrics["optim/grad_norm"] == pytest.approx(expected["optim/grad_norm"], rel=0.05)  # an fp32 norm


def test_the_optimizer_state_of_a_bf16_model_is_fp32():
    model = bf16_model()
    bf16 = trainer(model)
    bf16.step(batch(model))
    states = bf16.state_dict()["optimizer"]["state"]
    assert len(states) == len(list(model.parameters()))
    for state in states.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert all(w.dtype == torch.bfloat16 for w in bf16.weights().values()), "the engine loads bf16 weights"


def test_a_resumed_bf16_trainer_continues_bit_identically_from_its_masters():
    """The checkpoint holds the bf16 model and the trainer state: resuming from them must give the uninterrupted
    run's weights and masters exactly, which needs the fp32 masters (the bf16 weights lost their low bits)."""
    rows = [batch(bf16_model(), seed) for seed in range(4)]
    whole = trainer(bf16_model())
    for step in rows:
        whole.step(step)
    first = trainer(bf16_model())
    for step in rows[:2]:
        first.step(step)
    state = copy.deepcopy(first.state_dict())  # as torch.save would: no tensor shared with the live trainer
    saved_model = copy.deepcopy(first.model.state_dict())
    assert any(not torch.equal(m, saved_model[n].float()) for n, m in state["master_weights"].items()), \
        "the masters must hold more than the bf16 weights, or this test shows nothing"

    def resume(trainer_state):
        model = bf16_model(seed=1)  # other weights: everything must come from the checkpoint
        model.load_state_dict(saved_model)
        resumed = trainer(model)
        resumed.load_state_dict(copy.deepcopy(trainer_state))
        for step in rows[2:]:
            resumed.step(step)
        return resumed

    resumed = resume(state)
    assert resumed.version == whole.version == 4
    for name, weight in whole.weights().items():
        assert torch.equal(resumed.weights()[name], weight), name
    for name, master in whole.state_dict()["master_weights"].items():
        assert torch.equal(resumed.state_dict()["master_weights"][name], master), name
    without = resume({k: v for k, v in state.items() if k != "master_weights"})
    assert any(not torch.equal(without.state_dict()["master_weights"][n], m)
               for n, m in whole.state_dict()["master_weights"].items())


def bf16_trainer() -> Trainer:
    """The factory the child process runs (module level, so it is importable there by name)."""
    return trainer(bf16_model())


@pytest.mark.slow  # starts a trainer process (~5 s)
def test_the_trainer_process_carries_the_masters_both_ways():
    source = bf16_trainer()
    source.step(batch(source.model))
    state = source.state_dict()
    remote = TrainerProcess(bf16_trainer, (), threads=1)
    try:
        remote.load_state_dict(state)
        back = remote.state_dict()
        for name, master in state["master_weights"].items():
            assert torch.equal(back["master_weights"][name], master), name
        for name, weight in source.weights().items():  # published: the masters rounded, as inline
            assert torch.equal(remote.weights()[name], weight), name
    finally:
        remote.close()


def test_sft_on_a_bf16_model_keeps_small_updates():
    generator = torch.Generator().manual_seed(0)
    examples = [(torch.randint(1, VOCAB, (3,), generator=generator).tolist(),
                 torch.randint(1, VOCAB, (4,), generator=generator).tolist()) for _ in range(16)]
    model = bf16_model()
    reference = copy.deepcopy(model).float()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    for net in (model, reference):
        sft_warm_start(net, examples, steps=20, batch_size=8, lr=1e-5, seed=0, pad_token_id=0)
    moved, agree = rounded_like_reference(model, reference, initial)
    assert moved > 0.5, "the test needs updates that exceed the bf16 rounding step"
    assert agree > 0.95


def test_sft_in_the_trainers_bf16_hands_on_fp32_masters():
    """precision.trainer=bf16 runs a warm start in bf16 over fp32 masters; what comes back is the fp32 model
    holding the masters, not their bf16 rounding, and close to the same warm start in fp32."""
    generator = torch.Generator().manual_seed(0)
    examples = [(torch.randint(1, VOCAB, (3,), generator=generator).tolist(),
                 torch.randint(1, VOCAB, (4,), generator=generator).tolist()) for _ in range(16)]
    model = build_model(VOCAB, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=64, seed=0)
    reference = copy.deepcopy(model)
    start = flat_weights(model)
    dtypes = set()
    losses = sft_warm_start(model, examples, steps=20, batch_size=8, lr=1e-3, seed=0, pad_token_id=0,
                            numerics=Numerics(precision="bf16"),
                            on_step=lambda step, loss: dtypes.add(next(model.parameters()).dtype))
    sft_warm_start(reference, examples, steps=20, batch_size=8, lr=1e-3, seed=0, pad_token_id=0)
    assert dtypes == {torch.bfloat16}
    assert losses[-1] < losses[0]
    weights, expected = flat_weights(model), flat_weights(reference)
    assert weights.dtype == torch.float32
    assert (weights != weights.bfloat16().float()).float().mean() > 0.9  # unrounded masters
    assert (weights - expected).abs().mean() < 0.2 * (expected - start).abs().mean()


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])  # a copy


def test_an_fp32_model_is_stepped_in_place_without_masters():
    model = build_model(VOCAB, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=64)
    fp32 = trainer(model)
    assert [id(p) for p in fp32.masters.params] == [id(p) for p in model.parameters()]
    fp32.step(batch(model))
    assert "master_weights" not in fp32.state_dict()
