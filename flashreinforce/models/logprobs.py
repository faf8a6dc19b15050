"""Per-token log-probs and entropies of a causal LM: the trainer's view of the policy.

The rollout engine runs the same model forward (with a KV cache) and the same fp32 log-softmax,
which is why behavior and recomputed log-probs agree to float rounding in fp32. This module knows
nothing about losses or sampling.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

# Row chunks keep the fp32 (rows, T, V) intermediates of the log-softmax near this many elements.
_CHUNK_ELEMENTS = 1 << 25


def token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    temperature: float | torch.Tensor = 1.0,
    with_entropy: bool = True,
    images: Sequence[Sequence[bytes]] = (),
    from_token: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each token given the tokens before it, aligned with the tokens.

        logprobs[b, t]  = log softmax(z[b, t-1] / temperature)[input_ids[b, t]]     for t >= 1
        entropies[b, t] = -sum_v p(v) log p(v),  p = softmax(z[b, t-1] / temperature)
        both are 0 at t = 0, and wherever token t or token t-1 is padding

    `from_token`: the first token whose log-prob is wanted; earlier ones get 0 and their logits are never
    computed (the model's `logits_to_keep`). A batch's prompts come first and need none: on SmolLM2's 49k
    vocabulary the LM head and the fp32 softmax over it were most of a training step's non-matmul time.

    `temperature` is one for every row, or (B,) one per row (a mixture of tasks sampled at different ones).
    `images`: each row's encoded images, for a model that reads them (models/vision.py); its image tokens are
    banned from the distribution as the engine bans them from sampling, and get log-prob 0 (they are prompt).
    z are the model's logits, upcast to at least fp32 before the softmax. input_ids and attention_mask are
    (B, T); padding may sit on either side (positions count only real tokens). Gradients flow
    through logprobs when called under grad; entropies are always detached (they feed masks and
    metrics, not the loss). Returns (logprobs (B, T), entropies (B, T) or None), fp32 (fp64 for an
    fp64 model).
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} differs from input_ids {tuple(input_ids.shape)}"
        )
    per_row = isinstance(temperature, torch.Tensor)
    if per_row and temperature.shape != input_ids.shape[:1]:
        raise ValueError(f"temperature of shape {tuple(temperature.shape)}: give a number or one per row "
                         f"({input_ids.shape[0]},)")
    if not bool(torch.all(torch.as_tensor(temperature) > 0)):
        raise ValueError(f"temperature={temperature}: must be > 0 (greedy decoding has no log-probs to recompute)")
    position_ids = None
    if attention_mask is not None:
        # Positions count real tokens only, as in the engine, so left padding works too.
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)  # (B, T)
    image_kwargs = image_arguments(model, images)
    if image_kwargs and hasattr(model, "rope_positions"):  # M-RoPE (Qwen2-VL): (3, B, T), computed as the engine does
        rope = model.rope_positions(input_ids, attention_mask, images)
        position_ids = position_ids if rope is None else rope
    first = min(max(from_token, 1), input_ids.shape[1])
    keep = input_ids.shape[1] - first + 1  # the last `keep` positions' logits predict tokens first..T-1
    trimmed = first > 1 and _takes_logits_to_keep(model)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
        **({"logits_to_keep": keep} if trimmed else {}), **image_kwargs,
    ).logits
    logits = logits[:, (0 if trimmed else first - 1) : -1]  # (B, T-first, V): logits[:, t] predicts input_ids[:, first + t]
    targets = input_ids[:, first:]  # (B, T-first)
    banned = list(getattr(model, "banned_token_ids", ()))
    if banned:
        logits = logits.index_fill(-1, torch.tensor(banned, device=logits.device), float("-inf"))

    B, T1, V = logits.shape  # T1 = T - first
    dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16/fp16 -> fp32; fp64 stays fp64
    rows = max(1, _CHUNK_ELEMENTS // max(1, T1 * V))
    lp_chunks, ent_chunks = [], []
    for start in range(0, B, rows):
        scale = temperature[start : start + rows, None, None].to(logits.device, dtype) if per_row else temperature
        z = logits[start : start + rows].to(dtype) / scale  # (b, T-first, V)
        lse = torch.logsumexp(z, dim=-1)  # (b, T-first)
        lp_chunks.append(z.gather(-1, targets[start : start + rows, :, None]).squeeze(-1) - lse)
        if with_entropy:
            with torch.no_grad():
                p = (z - lse[..., None]).exp()  # (b, T-first, V)
                ent_chunks.append(-torch.xlogy(p, p).sum(-1))  # xlogy: 0 log 0 = 0
    logprobs = torch.nn.functional.pad(torch.cat(lp_chunks), (first, 0))  # (B, T)
    if banned:  # banned targets are image tokens of the prompt: -inf under the banned distribution, never trained
        logprobs = logprobs.masked_fill(torch.isin(input_ids, torch.tensor(banned, device=input_ids.device)), 0.0)
    entropies = torch.nn.functional.pad(torch.cat(ent_chunks), (first, 0)) if with_entropy else None
    if attention_mask is not None:
        # A token has a log-prob only if a real token precedes it (this also drops left padding).
        real = attention_mask.bool()  # (B, T)
        keep = real & torch.nn.functional.pad(real[:, :-1], (1, 0), value=False)  # (B, T)
        logprobs = logprobs.masked_fill(~keep, 0.0)
        entropies = entropies.masked_fill(~keep, 0.0) if entropies is not None else None
    return logprobs, entropies


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    parameters = inspect.signature(model.forward).parameters.values()
    return any(p.name == "logits_to_keep" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def first_marked(mask: torch.Tensor) -> int:
    """The first column of a (B, T) mask that any row marks (T when none does): `from_token` for the tokens a
    loss trains."""
    marked = mask.bool().any(0)  # (T,)
    return int(marked.int().argmax()) if bool(marked.any()) else mask.shape[1]


def image_arguments(model: Any, images: Sequence[Sequence[bytes]]) -> dict[str, torch.Tensor]:
    """The forward's image arguments for rows' images, in row order ({} when no row has one). A model without
    an image input is an error naming the fix, not a silent text-only forward."""
    flat = [image for row in images for image in row]
    if not flat:
        return {}
    if not hasattr(model, "image_inputs"):
        raise ValueError(f"{len(flat)} images given to a text-only model ({type(model).__name__}): use a model "
                         "that reads images (model.tiny.vision, or a vision-language model.path)")
    return model.image_inputs(flat)
