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

from flashreinforce.models.packing import Packing, packed_masks

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
        logprob, entropy = _distribution_stats(logits[start : start + rows], targets[start : start + rows], scale,
                                               dtype, with_entropy)
        lp_chunks.append(logprob)
        ent_chunks += [entropy] if with_entropy else []
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


def _distribution_stats(logits: torch.Tensor, targets: torch.Tensor, scale: float | torch.Tensor,
                        dtype: torch.dtype, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / scale)[targets] and (detached) the entropy of the same distribution, over the last
    dimension: (..., V), (...) -> (...), (...) or None."""
    z = logits.to(dtype) / scale  # (..., V)
    lse = torch.logsumexp(z, dim=-1)  # (...)
    logprob = z.gather(-1, targets[..., None]).squeeze(-1) - lse
    if not with_entropy:
        return logprob, None
    with torch.no_grad():
        p = (z - lse[..., None]).exp()  # (..., V)
        return logprob, -torch.xlogy(p, p).sum(-1)  # xlogy: 0 log 0 = 0


def packed_token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    packing: Packing,
    *,
    temperature: float | torch.Tensor = 1.0,
    with_entropy: bool = True,
    from_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_logprobs of right-padded rows, computed on their packed form (models/packing.py): the same values up
    to float rounding, in the same (B, T) layout, from a forward over `packing.cells` tokens instead of B x T.

    `from_tokens`: (B,) each row's first token whose log-prob is wanted (default 1); the LM head and the softmax
    run only at the positions that predict a wanted token (transformers' boolean logits_to_keep, where the
    installed version has it). `temperature`: one, or (B,) one per row. Rows must be right padded
    (`attention_mask` a prefix of ones in each row, as collate makes them). Returns (logprobs, entropies or None),
    0 where nothing is wanted.
    """
    B, T = input_ids.shape
    if attention_mask.shape != (B, T) or (packing.rows, packing.row_width) != (B, T):
        raise ValueError(f"rows {tuple(input_ids.shape)}, mask {tuple(attention_mask.shape)} and packing "
                         f"({packing.rows}, {packing.row_width}) must agree")
    real = attention_mask.bool()
    columns = torch.arange(T, device=input_ids.device)
    first = torch.ones(B, dtype=torch.long, device=input_ids.device) if from_tokens is None else from_tokens
    first = first.clamp(min=1)  # token 0 has nothing before it
    wanted = real & (columns[None] >= first[:, None])  # (B, T): token t's log-prob is wanted
    # the logits at position t predict token t + 1: keep them where that token is wanted
    keep = packing.pack(torch.nn.functional.pad(wanted[:, 1:], (0, 1), value=False), False)  # (n, W)
    next_ids = packing.pack(torch.nn.functional.pad(input_ids[:, 1:], (0, 1)))[keep]  # (N,)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft (LoRA) wrapper's model
    eager = base.config._attn_implementation == "eager"
    masks = packed_masks(packing, base.config, base.dtype if eager else None)
    logits = model(input_ids=packing.pack(input_ids), attention_mask=masks, position_ids=packing.positions,
                   use_cache=False, **({"logits_to_keep": keep} if _mask_keep(model) else {})).logits
    if logits.shape[:-1] == keep.shape:
        logits = logits[keep]  # (N, V)
    elif logits.shape[:-1] != next_ids.shape:
        raise ValueError(f"{type(model).__name__} returned logits of shape {tuple(logits.shape)} for packed rows "
                         f"{tuple(keep.shape)} with {int(keep.sum())} positions kept")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    per_row = isinstance(temperature, torch.Tensor)
    if per_row:
        temperature = packing.pack(temperature.to(logits.device, dtype)[:, None].expand(B, T).contiguous(), 1.0)[keep]
    chunk = max(1, _CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    lp_chunks, ent_chunks = [], []
    for start in range(0, logits.shape[0], chunk):
        scale = temperature[start: start + chunk, None] if per_row else temperature
        logprob, entropy = _distribution_stats(logits[start: start + chunk], next_ids[start: start + chunk], scale,
                                               dtype, with_entropy)
        lp_chunks.append(logprob)
        ent_chunks += [entropy] if with_entropy else []

    if not lp_chunks:  # no row wants a log-prob
        zeros = torch.zeros(B, T, dtype=dtype, device=logits.device)
        return zeros, (zeros if with_entropy else None)

    def unpacked(values: torch.Tensor) -> torch.Tensor:  # (N,) at kept positions -> (B, T) at the predicted tokens
        rows = packing.unpack(values.new_zeros(keep.shape).masked_scatter(keep, values))
        return torch.nn.functional.pad(rows[:, :-1], (1, 0))

    logprobs = unpacked(torch.cat(lp_chunks))
    entropies = unpacked(torch.cat(ent_chunks)) if with_entropy else None
    return logprobs, entropies


def _mask_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes a boolean (B, T) logits_to_keep: transformers' slice_logits_to_keep (5.2x)
    reads it as positions to keep, flattened; older versions would index with it wrongly."""
    from transformers import modeling_utils

    return _takes_logits_to_keep(model) and hasattr(modeling_utils, "slice_logits_to_keep")


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    parameters = inspect.signature(model.forward).parameters.values()
    return any(p.name == "logits_to_keep" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def first_marked(mask: torch.Tensor) -> int:
    """The first column of a (B, T) mask that any row marks (T when none does): `from_token` for the tokens a
    loss trains."""
    marked = mask.bool().any(0)  # (T,)
    return int(marked.int().argmax()) if bool(marked.any()) else mask.shape[1]


def first_marked_rows(mask: torch.Tensor) -> torch.Tensor:
    """(B,) each row's first marked column of a (B, T) mask (T when the row marks none): per-row `from_tokens`."""
    marked = mask.bool()
    first = marked.int().argmax(dim=1)
    return torch.where(marked.any(dim=1), first, torch.full_like(first, mask.shape[1]))


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
