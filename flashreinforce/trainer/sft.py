"""Supervised warm start: token-level cross-entropy on completions, prompts masked out.

It uses the same `token_logprobs` as RL training, so the SFT model and the RL policy are the same function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from flashreinforce.models.logprobs import token_logprobs
from flashreinforce.trainer.precision import MasterWeights


class ImageExample(NamedTuple):
    """An example that reads images: its ids hold their expanded image tokens (models/image_tokens.py), the
    prompt's and, in a multi-turn trace, the observations' among the completion's forced tokens."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    images: tuple[bytes, ...]
    """Every image of the row, in placeholder order."""
    completion_mask: Sequence[int] | None = None
    """1 = a target; None: every completion token is one."""


def sft_warm_start(
    model: torch.nn.Module,
    examples: Sequence[tuple[Sequence[int], Sequence[int]] | tuple[Sequence[int], Sequence[int], Sequence[int]]
                       | ImageExample],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    pad_token_id: int,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train on (prompt_ids, completion_ids[, completion_mask]) examples, or ImageExamples; returns the loss of
    each step.

    A completion mask (1 = a target) leaves forced tokens of multi-turn traces (observations) untrained, as
    RL's loss_mask does.

    Batches are drawn with replacement from a seeded generator, so the warm start is reproducible.
    """
    if not examples:
        raise ValueError("SFT needs at least one example")
    generator = torch.Generator().manual_seed(seed)
    masters = MasterWeights(model)  # a bf16 model steps fp32 masters, else small updates round away
    optimizer = torch.optim.AdamW(masters.params, lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        picks = torch.randint(len(examples), (batch_size,), generator=generator).tolist()
        rows = [(list(examples[i][0]), list(examples[i][1])) for i in picks]
        masks = [_completion_mask(examples[i]) for i in picks]
        images = tuple(examples[i].images if isinstance(examples[i], ImageExample) else () for i in picks)
        width = max(len(p) + len(c) for p, c in rows)
        input_ids = torch.full((batch_size, width), pad_token_id, dtype=torch.long)  # (B, T)
        attention_mask = torch.zeros((batch_size, width), dtype=torch.bool)
        target_mask = torch.zeros((batch_size, width), dtype=torch.bool)
        for row, ((prompt, completion), mask) in enumerate(zip(rows, masks)):
            n = len(prompt) + len(completion)
            input_ids[row, :n] = torch.tensor(prompt + completion)
            attention_mask[row, :n] = True
            target_mask[row, len(prompt):n] = torch.tensor(mask, dtype=torch.bool)
        logprobs, _ = token_logprobs(model, input_ids, attention_mask, with_entropy=False,
                                     images=images if any(images) else ())
        loss = -(logprobs * target_mask).sum() / target_mask.sum()
        model.zero_grad(set_to_none=True)  # the masters' grads are assigned whole by grads_to_masters
        loss.backward()
        masters.grads_to_masters()
        optimizer.step()
        masters.copy_to_model()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


def _completion_mask(example: tuple) -> list[int]:
    if isinstance(example, ImageExample):
        mask = example.completion_mask
        return [1] * len(example.completion_ids) if mask is None else list(mask)
    if len(example) == 2:
        return [1] * len(example[1])
    return list(example[2])
