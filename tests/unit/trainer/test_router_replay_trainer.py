"""The trainer replays the rollout's MoE routes (R3) and reports mismatch figures that separate numerics from lag."""

import copy

import torch

from flashreinforce.envs.single_turn import to_trajectory
from flashreinforce.models import build_model
from flashreinforce.models.numerics import Numerics
from flashreinforce.rollout.engine import Engine
from flashreinforce.trainer.batching import collate
from flashreinforce.trainer.trainer import OptimizerSettings, Trainer
from flashreinforce.types import Prompt, RolloutKey, SamplingParams, Verdict

OPTIMIZER = OptimizerSettings(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=0, total_steps=10,
                              min_lr_ratio=1.0, grad_clip=1.0)
DEFAULT_NUMERICS = Numerics()


def _moe():
    model = build_model(48, 64, 2, 4, 96, eos_token_id=1, pad_token_id=0, num_experts=8, experts_per_token=2, seed=2)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(3.0)  # peaked distributions and routers, like a trained model's
    return model


def _trajectories(model, trainer_weights, rollout: Numerics, count: int = 24):
    engine = Engine(copy.deepcopy(model), max_batch_size=count, max_context=80, eos_token_ids=1, numerics=rollout)
    engine.load_weights(trainer_weights, version=0)
    generator = torch.Generator().manual_seed(5)
    for i in range(count):
        engine.submit(str(i), torch.randint(2, 48, (6,), generator=generator).tolist(),
                      SamplingParams(max_new_tokens=40, seed=i))
    finished = []
    while engine.has_work:
        finished += engine.step()
    finished.sort(key=lambda g: int(g.request_id))
    return [to_trajectory(RolloutKey(g.request_id, 0), Prompt(g.request_id, "x", "y"), i, g,
                          Verdict(reward=float(i % 2), passed=bool(i % 2))) for i, g in enumerate(finished)]


def _step(model, rollout: Numerics, *, replay: bool, trainer_numerics: Numerics = DEFAULT_NUMERICS) -> dict[str, float]:
    trainer = Trainer(copy.deepcopy(model), loss="flashreinforce", loss_options={}, optimizer=OPTIMIZER,
                      microbatch_size=8, pad_token_id=0, temperature=1.0, max_new_tokens=40,
                      numerics=trainer_numerics, router_replay=replay)
    return trainer.step(_trajectories(model, trainer.weights(), rollout))


def test_same_numerics_give_no_route_disagreement_and_float_level_gaps():
    metrics = _step(_moe(), Numerics(), replay=True)
    assert metrics["mismatch/route_disagreement"] == 0.0
    assert metrics["mismatch/same_weights_abs_max"] < 1e-4
    assert metrics["mismatch/same_weights_tokens"] == metrics["batch/policy_tokens"]  # every token lag 0
    assert metrics["mismatch/gate_rejected_fraction"] == 0.0


def test_replay_narrows_a_bf16_rollout_mismatch_and_route_disagreement_is_measured_either_way():
    model = _moe()
    plain = _step(model, Numerics("bf16"), replay=False)
    replayed = _step(model, Numerics("bf16"), replay=True)
    # Without replay a later layer's own choice also follows from the trainer's earlier-layer experts, with replay
    # from the recorded ones: both count overridden choices, and both see the bf16 rollout's routing differ.
    assert plain["mismatch/route_disagreement"] > 0 and replayed["mismatch/route_disagreement"] > 0
    assert replayed["mismatch/same_weights_abs_mean"] < plain["mismatch/same_weights_abs_mean"]
    assert replayed["mismatch/same_weights_abs_max"] < plain["mismatch/same_weights_abs_max"]


def test_unified_bf16_moe_agrees_to_float_rounding():
    unified = Numerics("bf16", unified=True)
    metrics = _step(_moe(), unified, replay=True, trainer_numerics=unified)
    assert metrics["mismatch/same_weights_abs_max"] < 1e-4
    assert metrics["mismatch/route_disagreement"] == 0.0


def test_collate_pads_routes_with_no_route():
    model = _moe()
    trajectories = _trajectories(model, model.state_dict(), Numerics(), count=3)
    batch = collate(trajectories, pad_token_id=0)
    assert batch.routes.shape == (*batch.input_ids.shape, 2, 2) and batch.routes.dtype == torch.int16
    assert bool((batch.routes[~batch.attention_mask] == -1).all())
    for row, trajectory in enumerate(trajectories):
        n = len(trajectory.tokens)
        assert bool((batch.routes[row, : n - 1] >= 0).all())  # every position the engine read has a route
    short = min(range(3), key=lambda r: len(trajectories[r].tokens))
    assert batch.rows(short, short + 1).routes.shape[1] == len(trajectories[short].tokens)
