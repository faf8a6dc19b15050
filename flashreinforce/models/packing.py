"""Rows of different lengths packed side by side into fewer, fuller rows: the trainer's padding-free forward.

    rows (right padded, width 5)          packed (2 rows of width 5)
    [a a a a a]                           [a a a a a]   positions [0 1 2 3 4]
    [b b . . .]              ->           [c c c b b]   positions [0 1 2 0 1]
    [c c c . .]

A packed row holds whole rows one after another (a row never spans two packed rows), every row's positions start
at 0, and the attention masks keep rows apart: each token attends only to the earlier tokens of its own row (a
block-diagonal causal mask, each sliding layer's window within it), so every row computes what it computes alone,
padded or not, up to float rounding. The masks are 4D, built here as the engine builds its own (one per layer type
where the family's layers differ), which every family of models/families.py takes; transformers' own detection of
packed rows from restarting positions is not relied on (GPT-OSS, for one, does not pass positions to it). What is
left at the end of a packed row is filler, each filler token attending only to itself, whose outputs nobody reads.
This module plans, masks and moves tensors; models/logprobs.py runs the packed forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashreinforce.models.cpu_attention import FP32_SDPA
from flashreinforce.models.families import FAMILIES, attention_windows

PACKED_ATTENTION = ("sdpa", "eager", FP32_SDPA)
"""Attention implementations that take the 4D masks (tests/unit/models/test_packed_forward.py). Flash attention reads no
such mask (packed rows would need its variable-length kernels, untested here) and flex needs block masks: a model
loaded with either trains padded. FP32_SDPA is sdpa (cpu_attention.py)."""


def first_fit_decreasing(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Row indices into bins of `width` tokens: the longest row first, each into the first bin it fits, else a new
    bin. Bins in the order they were opened, each bin's rows in the order they were placed.

    Example: lengths [2, 5, 3], width 5 -> [[1], [2, 0]].
    """
    if any(length > width for length in lengths):
        raise ValueError(f"a row of {max(lengths)} tokens does not fit packed rows of width {width}")
    bins: list[list[int]] = []
    free: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep batch order
        for index, room in enumerate(free):
            if lengths[row] <= room:
                bins[index].append(row)
                free[index] -= lengths[row]
                break
        else:
            bins.append([row])
            free.append(width - lengths[row])
    return bins


@dataclass(frozen=True, eq=False)
class Packing:
    """Where each real token of a (b, T) right-padded microbatch sits in its (n, W) packed form."""

    rows: int
    row_width: int
    packed_rows: int
    width: int
    source: torch.Tensor
    """(R,) long: each real token's flat index in the (b * T) padded layout."""
    target: torch.Tensor
    """(R,) long: the same token's flat index in the (n * W) packed layout."""
    positions: torch.Tensor
    """(n, W) long: each packed token's position within its own row; 0 for filler."""
    segments: torch.Tensor
    """(n, W) long: which row each packed token belongs to; a distinct negative number for each filler token."""

    @classmethod
    def of(cls, bins: Sequence[Sequence[int]], lengths: Sequence[int], row_width: int,
           device: torch.device | str = "cpu") -> Packing:
        """The packing of rows (their `lengths`, in a layout `row_width` wide) into `bins`: each bin one packed
        row holding its rows in order, as wide as the fullest bin."""
        width = max(sum(lengths[row] for row in rows) for rows in bins)
        source, target = [], []
        positions = torch.zeros(len(bins), width, dtype=torch.long)
        segments = -1 - torch.arange(len(bins) * width).view(len(bins), width)  # filler: each token its own
        for index, rows in enumerate(bins):
            offset = 0
            for row in rows:
                n = lengths[row]
                source.append(torch.arange(n) + row * row_width)
                target.append(torch.arange(n) + index * width + offset)
                positions[index, offset: offset + n] = torch.arange(n)
                segments[index, offset: offset + n] = row
                offset += n
        return cls(len(lengths), row_width, len(bins), width, torch.cat(source).to(device),
                   torch.cat(target).to(device), positions.to(device), segments.to(device))

    @property
    def cells(self) -> int:
        """Tokens the model is fed: packed rows x width."""
        return self.packed_rows * self.width

    def pack(self, rows: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
        """(b, T, ...) -> (n, W, ...): each row's real tokens in its packed place, `fill` elsewhere."""
        flat = rows.reshape(self.rows * self.row_width, *rows.shape[2:])
        packed = flat.new_full((self.packed_rows * self.width, *rows.shape[2:]), fill)
        packed = packed.index_put((self.target,), flat[self.source])
        return packed.view(self.packed_rows, self.width, *rows.shape[2:])

    def unpack(self, packed: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
        """(n, W, ...) -> (b, T, ...): the inverse of pack on real tokens, `fill` on padding; differentiable."""
        flat = packed.reshape(self.packed_rows * self.width, *packed.shape[2:])
        rows = flat.new_full((self.rows * self.row_width, *packed.shape[2:]), fill)
        rows = rows.index_put((self.source,), flat[self.target])
        return rows.view(self.rows, self.row_width, *packed.shape[2:])


def packed_masks(packing: Packing, config: object,
                 additive_dtype: torch.dtype | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
    """The forward's attention masks for packed rows: (n, 1, W, W), True where a query may attend to a key (its own
    row, at or before it; for sliding layers also within the window, HF's rule q - window < k). One mask when every
    layer is alike, else one per layer type, as the engine gives them (rollout/engine.py _masks). `additive_dtype`:
    eager attention's form instead, 0 where allowed and the dtype's minimum elsewhere."""
    queries, keys = packing.positions[:, :, None], packing.positions[:, None, :]  # (n, W, 1), (n, 1, W)
    causal = (packing.segments[:, :, None] == packing.segments[:, None, :]) & (keys <= queries)  # (n, W, W)

    def shaped(allowed: torch.Tensor) -> torch.Tensor:
        allowed = allowed[:, None]  # (n, 1, W, W)
        if additive_dtype is None:
            return allowed
        return torch.zeros(allowed.shape, dtype=additive_dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(additive_dtype).min)

    windows = attention_windows(config)
    if windows.window is None:
        return shaped(causal)
    sliding = shaped(causal & (keys > queries - windows.window))
    if not windows.per_layer_type:
        return sliding
    return {"full_attention": shaped(causal), "sliding_attention": sliding}


def packing_problem(model: torch.nn.Module) -> str | None:
    """Why this model's rows cannot be packed (None when they can): packing needs a language model of a family the
    engine serves (models/families.py: its forward takes 4D masks for every attention layer; each is tested packed)
    and an attention implementation in PACKED_ATTENTION. A model that reads images trains padded."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft (LoRA) wrapper's model
    if hasattr(base, "image_inputs"):
        return f"{type(base).__name__} reads images, and rows with images are not packed"
    config = getattr(base, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"model family {kind!r} is not among those tested packed ({', '.join(sorted(FAMILIES))})"
    attention = getattr(config, "_attn_implementation", None)
    if attention not in PACKED_ATTENTION:
        return (f"its attention implementation {attention!r} is not one the packed masks are tested with "
                f"({', '.join(PACKED_ATTENTION)})")
    return None
