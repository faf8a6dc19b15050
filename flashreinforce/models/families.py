"""The model families the local engine serves exactly, and how each one's attention is masked.

The engine feeds a model its own 4D attention masks (one row per request, each at its own length) and keeps
the keys and values in its own cache, so it can serve a family only where the family's forward takes those
masks for every attention layer and keeps no state but attention keys and values. Each family below passes
the engine's exactness tests (tests/unit/rollout/test_engine_families.py: behavior log-probs equal the
trainer's recompute through pause/resume and a weight push); any other family is refused by name rather
than served with wrong masks (chunked or bidirectional attention, linear-attention or state-space layers).
This module knows nothing about requests, sampling or routing (models/moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from torch import nn
from transformers import PreTrainedModel

from flashreinforce.models.cpu_attention import FP32_SDPA

Window = Literal["none", "model", "layer_types"]


@dataclass(frozen=True)
class Family:
    """How one family's forward masks attention."""

    window: Window
    """none: every layer attends to all earlier positions; model: config.sliding_window, when set, bounds every
    layer (the forward takes one mask); layer_types: config.layer_types names each layer full_attention or
    sliding_attention (the forward takes a mask per layer type)."""


FAMILIES: dict[str, Family] = {
    # dense, full attention
    "gpt2": Family("none"),
    "llama": Family("none"),
    "gemma": Family("none"),
    # sliding windows: one for the whole model, or per layer (Gemma's local/global layers)
    "mistral": Family("model"),
    "phi3": Family("model"),
    "qwen2": Family("layer_types"),
    "qwen3": Family("layer_types"),
    "gemma2": Family("layer_types"),
    "gemma3_text": Family("layer_types"),
    # mixture of experts (models/moe.py says which routers are replayed)
    "mixtral": Family("model"),
    "qwen2_moe": Family("layer_types"),
    "qwen3_moe": Family("model"),
    "olmoe": Family("none"),
    "deepseek_v2": Family("none"),
    "deepseek_v3": Family("none"),
    "dbrx": Family("none"),
    "gpt_oss": Family("layer_types"),
    # the language models of the vision-language families (models/hf_vision.py; a window there is refused)
    "qwen2_vl_text": Family("layer_types"),
    "qwen2_5_vl_text": Family("layer_types"),
}
"""model_type -> Family, for every family the engine is tested to serve exactly."""

REFUSED: dict[str, str] = {
    "llama4_text": "Llama 4 attends in chunks on some layers, a mask the engine does not build",
    "qwen3_next": "Qwen3-Next keeps linear-attention state outside the attention cache",
    "jamba": "Jamba keeps state-space (Mamba) state outside the attention cache",
}
"""Families refused with a reason more specific than 'not tested'."""


@dataclass(frozen=True)
class Windows:
    """The sliding window of a model as the engine masks it (window None: no layer slides)."""

    window: int | None
    sliding_layers: frozenset[int]
    """Indices of the layers that attend within the window."""
    per_layer_type: bool
    """The forward takes a mask per layer type ({"full_attention": ..., "sliding_attention": ...})."""


def engine_family(config: Any) -> Family:
    """The Family of a text config, or a ValueError naming the family and the supported ones."""
    kind = config.model_type
    if kind in FAMILIES:
        return FAMILIES[kind]
    reason = REFUSED.get(kind, f"model family {kind!r} is not among those the local engine is tested to serve "
                               "exactly")
    raise ValueError(f"{reason}; the local engine serves {', '.join(sorted(FAMILIES))} (use rollout.engine=vllm "
                     "for another family)")


def attention_windows(config: Any) -> Windows:
    """Which layers of this config attend within a sliding window, and how wide it is (HF's rule: a query at
    index q sees keys at k with q - window < k <= q)."""
    family = engine_family(config)
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{config.model_type} with use_bidirectional_attention attends both ways (an embedding "
                         "model); the engine generates with causal attention")
    window = getattr(config, "sliding_window", None)
    layers = range(config.num_hidden_layers)
    if family.window == "model" and window is not None:
        return Windows(window, frozenset(layers), per_layer_type=False)
    if family.window == "layer_types":
        types = list(config.layer_types)
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"{config.model_type}: layer_types {unknown} are not attention the engine masks "
                             "(full_attention, sliding_attention)")
        sliding = frozenset(i for i in layers if types[i] == "sliding_attention")
        if sliding and window is not None:
            return Windows(window, sliding, per_layer_type=True)
    return Windows(None, frozenset(), per_layer_type=False)


# transformers' attention implementations that compute softmax attention as sdpa and eager do but cannot take
# the engine's per-request masks (flash kernels read only lengths, flex needs block masks, paged ones a paged
# cache): the engine runs its copy of the model with the masked equivalent instead. None: sdpa where the family
# has it, else eager. A copy of a model the trainer switched to its fp32 attention (cpu_attention.py) goes back
# to sdpa: the engine computes attention its own way.
_MASKED_EQUIVALENT: dict[str, str | None] = {
    "sdpa": "sdpa",
    FP32_SDPA: "sdpa",
    "eager": "eager",
    "paged|eager": "eager",
    "flash_attention_2": None,
    "flash_attention_3": None,
    "flash_attention_4": None,
    "flex_attention": None,
}


def head_dim(config: Any) -> int:
    """The width of one attention head: the config's head_dim where it sets one, else hidden_size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def engine_attention(model: nn.Module, config: Any) -> str:
    """The attention implementation the engine runs `model` with: sdpa or eager, switched to from a flash,
    flex or paged implementation (the same attention without the engine's masks). Anything else is refused
    naming what to set."""
    requested = config._attn_implementation
    if requested not in _MASKED_EQUIVALENT:
        raise ValueError(f"attention implementation {requested!r} is not one the local engine can mask per request: "
                         "load the model with attn_implementation='sdpa' (or 'eager'), or leave it unset")
    if requested in ("sdpa", "eager"):
        return requested
    if not isinstance(model, PreTrainedModel):  # a wrapper (a vision-language model) cannot switch its LM's
        raise TypeError(f"attention implementation {requested!r} cannot be switched on {type(model).__name__}: "
                        "load it with attn_implementation='sdpa' (or 'eager')")
    target = _MASKED_EQUIVALENT[requested] or ("sdpa" if model._supports_sdpa else "eager")
    model.set_attn_implementation(target)
    return target
