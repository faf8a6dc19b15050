"""An agent episode of several segments (Trajectory.segments): every segment trains as a row, and the episode
counts once in the baseline, its rows taking the episode's advantage."""

import dataclasses

import pytest
import torch

from flashreinforce.algorithms.advantages import grpo_advantages
from flashreinforce.models import build_model
from flashreinforce.trainer.batching import collate, first_rows
from flashreinforce.trainer.trainer import OptimizerSettings, Trainer
from flashreinforce.types import FORCED_VERSION, Prompt, RolloutKey, Trajectory, Verdict

VOCAB = 12


def row(tokens, prompt_length, reward, sample):
    mask = tuple(int(i >= prompt_length) for i in range(len(tokens)))
    return Trajectory(key=RolloutKey("p0", sample), prompt=Prompt("p0", "x", "1"), group=0, tokens=tuple(tokens),
                      loss_mask=mask, behavior_logprobs=tuple(-1.0 * m for m in mask),
                      policy_versions=tuple(0 if m else FORCED_VERSION for m in mask), prompt_length=prompt_length,
                      finish_reason="stop", verdict=Verdict(reward=reward, passed=reward > 0))


def trainer(model):
    return Trainer(model, loss="grpo", loss_options={}, microbatch_size=8, pad_token_id=0, temperature=1.0,
                   max_new_tokens=8, optimizer=OptimizerSettings(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999),
                                                                 warmup_steps=0, total_steps=10, min_lr_ratio=1.0,
                                                                 grad_clip=1e9))


def test_first_rows_finds_each_ids_first_row():
    assert first_rows(torch.tensor([0, 1, 0, 2, 1])).tolist() == [0, 1, 3]


def test_segments_are_rows_and_the_episode_counts_once_in_its_groups_baseline():
    episode = dataclasses.replace(row([1, 2, 3, 4], 2, 1.0, 0), segments=(row([1, 5, 6], 2, 1.0, 0),))
    other = row([1, 2, 7, 8, 9], 2, 0.0, 1)
    rows = [r for t in (episode, other) for r in t.rows()]
    assert [r.tokens for r in rows] == [(1, 5, 6), (1, 2, 3, 4), (1, 2, 7, 8, 9)]
    assert episode.oldest_version == 0 and all(r.segments == () for r in rows)
    batch = collate(rows, pad_token_id=0)
    assert batch.episode_ids.tolist() == [0, 0, 1]
    assert collate([episode, other], pad_token_id=0).episode_ids is None  # one row per episode: no ids

    model = build_model(VOCAB, 16, 1, 2, 32, dtype=torch.float64, seed=1)
    advantages = trainer(model)._advantages(batch, batch.rewards, batch.loss_mask.sum(dim=1))
    per_episode = grpo_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0, 0]))
    assert advantages.tolist() == pytest.approx(per_episode[[0, 0, 1]].tolist())

    metrics = trainer(model).step([episode, other])
    assert metrics["optim/grad_norm"] > 0
