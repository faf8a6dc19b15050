"""On-policy distillation on 2 gloo data-parallel ranks: each rank's teacher scores its own rows, and the ranks step
with the one process's gradient and report its reverse KL (normalization is global)."""

import math
import os

import pytest
import torch

from flashreinforce.models import build_model
from flashreinforce.trainer.distributed import RankGroup, join_group
from flashreinforce.trainer.group import TrainerGroup
from flashreinforce.trainer.teachers import Teachers
from flashreinforce.trainer.trainer import OptimizerSettings, Trainer
from flashreinforce.types import FORCED_VERSION, Prompt, RolloutKey, Trajectory, Verdict

VOCAB = 13
pytestmark = pytest.mark.slow  # rank processes of their own, ~10 s on 2 cores


def trainer(rank: int, grads_to: str, minibatches: int) -> Trainer:
    """A student and a differently seeded teacher; every optimizer step saves its gradient to grads_to/rank<r>.pt."""
    built = Trainer(build_model(VOCAB, 16, 2, 2, 48, seed=5), loss="opd", loss_options={"reward_weight": 0.5},
                    optimizer=OptimizerSettings(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=0,
                                                total_steps=10, min_lr_ratio=1.0, grad_clip=math.inf),
                    microbatch_size=2, pad_token_id=0, temperature=1.0, max_new_tokens=16, minibatches=minibatches,
                    teachers=Teachers({"": build_model(VOCAB, 16, 2, 2, 48, seed=6)}))
    path = os.path.join(grads_to, f"rank{rank}.pt")
    built.optimizer.register_step_pre_hook(lambda *_: torch.save([p.grad.clone() for p in built.masters.params], path))
    return built


def rank_trainer(grads_to: str, minibatches: int, group: RankGroup) -> Trainer:
    """The factory each rank's process runs (module level: importable there by name)."""
    torch.set_num_threads(1)
    join_group(group)
    return trainer(group.rank, grads_to, minibatches)


def batch(rows: int = 7) -> list[Trajectory]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(rows):
        n = 4 + int(torch.randint(0, 12, (1,), generator=g))
        tokens = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        mask = tuple(int(j >= 3) for j in range(n))
        out.append(Trajectory(
            key=RolloutKey(f"p{i}", 0), prompt=Prompt(id=f"p{i}", prompt="x", ground_truth="1"), group=i,
            tokens=tuple(tokens), loss_mask=mask, behavior_logprobs=tuple(-2.0 * m for m in mask),
            policy_versions=tuple(0 if m else FORCED_VERSION for m in mask), prompt_length=3, finish_reason="stop",
            verdict=Verdict(reward=float(i % 2), passed=i % 2 == 1)))
    return out


@pytest.mark.parametrize("minibatches", [1, 2])
def test_two_ranks_distill_with_the_one_process_gradient(tmp_path, one_thread, minibatches):
    (tmp_path / "single").mkdir()
    expected = trainer(0, str(tmp_path / "single"), minibatches).step(batch())
    reference = torch.load(tmp_path / "single" / "rank0.pt")
    assert expected["loss/reverse_kl"] != 0.0
    ranks = TrainerGroup(rank_trainer, (str(tmp_path), minibatches), world_size=2, backend="gloo", threads=1)
    try:
        got = ranks.step(batch())
        for rank in range(2):
            for mine, theirs in zip(torch.load(tmp_path / f"rank{rank}.pt"), reference, strict=True):
                torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
        for name in ("loss/policy", "loss/reverse_kl", "loss/sequence_reverse_kl", "optim/grad_norm"):
            assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name
    finally:
        ranks.close()
