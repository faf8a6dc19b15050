"""Supervised warm start: token-level cross-entropy on completions, prompts masked out.

It uses the same `token_logprobs` as RL training, so the SFT model and the RL policy are the same function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from flashreinforce.models.logprobs import first_marked, token_logprobs
from flashreinforce.models.numerics import Numerics
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
    numerics: Numerics | None = None,
) -> list[float]:
    """Train on (prompt_ids, completion_ids[, completion_mask]) examples, or ImageExamples; returns the loss of
    each step.

    A completion mask (1 = a target) leaves forced tokens of multi-turn traces (observations) untrained, as
    RL's loss_mask does.

    `numerics`: the trainer's (bf16, fp8 computes in bf16 over fp32 masters); the model comes back in its own
    dtype holding the masters unrounded.

    Batches are drawn with replacement from a seeded generator, so the warm start is reproducible.
    """
    if not examples:
        raise ValueError("SFT needs at least one example")
    generator = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    masters = MasterWeights(model, numerics)  # a bf16 model steps fp32 masters, else small updates round away
    optimizer = torch.optim.AdamW(masters.params, lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        picks = torch.randint(len(examples), (batch_size,), generator=generator).tolist()
        model.zero_grad(set_to_none=True)  # the masters' grads are assigned whole by grads_to_masters
        targets = sum(sum(_completion_mask(examples[i])) for i in picks)
        loss = 0.0
        for chunk in length_chunks([len(examples[i][0]) + len(examples[i][1]) for i in picks]):
            # The mean over every target of the batch, summed chunk by chunk: one chunk's backward at a time.
            chunk_loss = -_target_logprob_sum(model, [examples[picks[j]] for j in chunk], pad_token_id) / targets
            chunk_loss.backward()
            loss += float(chunk_loss.detach())
        masters.grads_to_masters()
        optimizer.step()
        masters.copy_to_model()
        losses.append(loss)
        if on_step is not None:
            on_step(step, losses[-1])
    if masters.numerics.formats_weights:
        model.to(dtype)
        masters.copy_unformatted_to_model()
    return losses


def length_chunks(lengths: Sequence[int], spread: float = 1.5) -> list[list[int]]:
    """Indices of `lengths` in runs of similar length (sorted; a run's longest at most `spread` x its shortest),
    so a batch that holds a few long rows (a multi-turn trace among short answers) pads each run to its own
    longest row instead of every row to the batch's longest."""
    chunks: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if chunks and lengths[index] <= spread * lengths[chunks[-1][0]]:
            chunks[-1].append(index)
        else:
            chunks.append([index])
    return chunks


def _target_logprob_sum(model: torch.nn.Module, examples: Sequence, pad_token_id: int) -> torch.Tensor:
    """The summed log-probability of the examples' target tokens, in one padded forward."""
    rows = [(list(example[0]), list(example[1])) for example in examples]
    images = tuple(example.images if isinstance(example, ImageExample) else () for example in examples)
    width = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    target_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for row, ((prompt, completion), example) in enumerate(zip(rows, examples)):
        n = len(prompt) + len(completion)
        input_ids[row, :n] = torch.tensor(prompt + completion)
        attention_mask[row, :n] = True
        target_mask[row, len(prompt):n] = torch.tensor(_completion_mask(example), dtype=torch.bool)
    logprobs, _ = token_logprobs(model, input_ids, attention_mask, with_entropy=False,
                                 images=images if any(images) else (), from_token=first_marked(target_mask))
    return (logprobs * target_mask).sum()


def _completion_mask(example: tuple) -> list[int]:
    if isinstance(example, ImageExample):
        mask = example.completion_mask
        return [1] * len(example.completion_ids) if mask is None else list(mask)
    if len(example) == 2:
        return [1] * len(example[1])
    return list(example[2])
