"""A LoRA push: the adapter alone, as a plain state dict, and the one merge the trainer's saves and the engines share.

An adapter push is a dict of tensors like a full push, so every way weights travel carries it unchanged (the local
engine's copy, a trainer process's shared memory, Ray's object store, the weight group's broadcast). For each
adapted linear layer <layer> (its name in the base model, whose weight is <layer>.weight):

    <layer>.lora_A      (r, in)    the adapter's A
    <layer>.lora_B      (out, r)   and B
    <layer>.lora_scale  ()  fp32   alpha / r (alpha / sqrt(r) with rslora)

and the trainer's own log-probs of the probe row at the pushed weights (PROBE_IDS, PROBE_LOGPROBS), which the engine
compares with its own after loading. A *base push* carries besides every tensor of the base model under its own
name, the adapted layers' weights unmerged: an engine keeps those layers' base from it and merges each later adapter
push into that (merge_weight), so the base travels once per engine. An adapter push reaching an engine that holds no
base is refused: the engine was built from a merged checkpoint, whose adapted weights are not the base.

Tensor names never contain "@" (they are dotted Python identifiers), so the probe's names cannot meet a weight's.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

ADAPTER_PARTS = ("lora_A", "lora_B", "lora_scale")
PROBE_IDS = "@probe.input_ids"
PROBE_LOGPROBS = "@probe.logprobs"
PROBE_LENGTH = 16


@dataclass(frozen=True)
class AdapterLayer:
    a: torch.Tensor  # (r, in)
    b: torch.Tensor  # (out, r)
    scale: torch.Tensor  # () fp32


@dataclass(frozen=True)
class AdapterPush:
    """An adapter push read apart (read_push)."""

    layers: dict[str, AdapterLayer]
    """By the adapted layer's name in the base model."""
    base: dict[str, torch.Tensor]
    """Every tensor of the base model, adapted layers unmerged ({} in an adapter-only push)."""
    probe: tuple[torch.Tensor, torch.Tensor] | None
    """The probe row (P,) and the trainer's log-probs of its tokens 1..P-1 at the pushed weights."""


def is_adapter_push(state: Mapping[str, torch.Tensor]) -> bool:
    return any(name.rpartition(".")[2] in ADAPTER_PARTS for name in state)


def read_push(state: Mapping[str, torch.Tensor]) -> AdapterPush:
    """The layers, base and probe of an adapter push; a ValueError naming the first layer that lacks a part or whose
    parts do not fit each other."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    base = {}
    for name, tensor in state.items():
        layer, _, part = name.rpartition(".")
        if part in ADAPTER_PARTS:
            parts.setdefault(layer, {})[part] = tensor
        elif name not in (PROBE_IDS, PROBE_LOGPROBS):
            base[name] = tensor
    layers = {}
    for layer, found in parts.items():
        missing = [part for part in ADAPTER_PARTS if part not in found]
        if missing:
            raise ValueError(f"adapter push: layer {layer} has no {', '.join(missing)}")
        a, b, scale = (found[part] for part in ADAPTER_PARTS)
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0] or scale.numel() != 1:
            raise ValueError(f"adapter push: layer {layer} has A {tuple(a.shape)}, B {tuple(b.shape)} and scale "
                             f"{tuple(scale.shape)}; B @ A needs A (r, in), B (out, r) and one scale")
        layers[layer] = AdapterLayer(a, b, scale.reshape(()))
    probe = (state[PROBE_IDS], state[PROBE_LOGPROBS]) if PROBE_IDS in state else None
    return AdapterPush(layers, base, probe)


def adapter_only(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An adapter push without its base (the probe stays)."""
    return {name: tensor for name, tensor in state.items()
            if name.rpartition(".")[2] in ADAPTER_PARTS or name in (PROBE_IDS, PROBE_LOGPROBS)}


def lora_delta(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """scale * B @ A in fp32 (peft's get_delta_weight of a Linear layer), (out, in)."""
    return (b.float() @ a.float()) * scale.float()


def merge_weight(base: torch.Tensor, layer: AdapterLayer) -> torch.Tensor:
    """The merged weight W + scale * B @ A, summed in fp32 and returned in W's dtype: the trainer's merged model
    (trainer/lora.py) and an engine's merge of an adapter push are this one computation."""
    a, b, scale = (t.to(base.device) for t in (layer.a, layer.b, layer.scale))
    return (base.float() + lora_delta(a, b, scale)).to(base.dtype)


def merged_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A base push as the full model's state dict, each adapted layer's weight merged (what an engine that loads only
    full weights is given; a state that is no adapter push is returned as it is)."""
    if not is_adapter_push(state):
        return dict(state)
    push = read_push(state)
    missing = [f"{layer}.weight" for layer in push.layers if f"{layer}.weight" not in push.base]
    if missing:
        raise ValueError(f"adapter push without the base of {missing[0]}: merged weights need a base push")
    merged = dict(push.base)
    for layer, adapter in push.layers.items():
        merged[f"{layer}.weight"] = merge_weight(push.base[f"{layer}.weight"], adapter)
    return merged


def probe_row(vocab_size: int, banned: Collection[int] = ()) -> tuple[int, ...]:
    """The weight probe's fixed token row: PROBE_LENGTH ids drawn from seed 0, never a banned one (an image token
    would stand for an image it does not have)."""
    rng, row = random.Random(0), []
    while len(row) < PROBE_LENGTH:
        token = rng.randrange(vocab_size)
        if token not in banned:
            row.append(token)
    return tuple(row)


@torch.no_grad()
def probe_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(P-1,) float64: log softmax of the model's raw logits (no temperature, nothing banned) at each probe token
    1..P-1 given the ones before it: what trainer and engine compare after a push."""
    logits = model(input_ids=ids[None].to(next(model.parameters()).device), use_cache=False).logits[0, :-1]
    logprobs = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
    return logprobs.gather(-1, ids[1:, None].to(logits.device))[:, 0].double().cpu()
