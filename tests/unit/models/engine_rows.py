"""What the vision tests share: an engine run to its end, its rows as tensors, and the largest gap between the
engine's behavior log-probs and the trainer's recompute of them (with each row's images)."""

import torch

from flashreinforce.models import token_logprobs
from flashreinforce.rollout.engine import Engine
from flashreinforce.types import Generation


def run_to_end(engine: Engine) -> list[Generation]:
    done = []
    while engine.has_work:
        done += engine.step()
    return sorted(done, key=lambda g: g.request_id)


def rows_of(generations: list[Generation]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of prompt + generated tokens, right padded."""
    width = max(len(g.prompt_ids) + len(g.token_ids) for g in generations)
    ids = torch.zeros(len(generations), width, dtype=torch.long)
    mask = torch.zeros(len(generations), width, dtype=torch.bool)
    for row, g in enumerate(generations):
        tokens = [*g.prompt_ids, *g.token_ids]
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = True
    return ids, mask


def recompute(model, generations: list[Generation], images=None) -> torch.Tensor:
    """The trainer's log-probs of the rows, each with its own images (or `images`, one tuple per row)."""
    ids, mask = rows_of(generations)
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, ids, mask, images=images or [g.images for g in generations])
    return logprobs


def max_logprob_gap(model, generations: list[Generation]) -> float:
    """Largest |behavior - recomputed| over sampled tokens of rows sampled by one version's weights."""
    recomputed, gap = recompute(model, generations), 0.0
    for row, g in enumerate(generations):
        start = len(g.prompt_ids)
        behavior = torch.tensor(g.behavior_logprobs)
        gap = max(gap, float((recomputed[row, start : start + len(g.token_ids)] - behavior).abs().max()))
    return gap
