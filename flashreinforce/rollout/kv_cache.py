"""A preallocated KV cache with one slot per running request, plugged into Hugging Face models.

keys[layer] and values[layer] are (S, H_kv, T, D): slot s holds request s's keys at positions
0..T-1. Running requests occupy slots 0..n-1 (the engine keeps them compact), so a decoding step
attends over the view keys[:n, :, :L] without copying or concatenating anything; a step split into
long and short rows reads each part's slots through a copy of their first L positions. Layers that attend
within a sliding window keep every position too (the window is a mask over positions), but a decoding step
hands them only positions from its window's start on, [window_start, L), the earliest any of its rows can see.
The cache only stores and returns tensors; masks, positions and which token goes where are the engine's
business, set before each forward with `plan_decode` or `plan_prefill`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class SlotCache(Cache):
    """KV slots for `num_slots` requests of up to `max_context` tokens, allocated on first use; `sliding_layers`
    are the indices of the layers that attend within a sliding window."""

    def __init__(self, num_slots: int, max_context: int, sliding_layers: frozenset[int] = frozenset()):
        super().__init__(layers=[])
        self.num_slots, self.max_context = num_slots, max_context
        self.sliding_layers = sliding_layers
        self._keys: dict[int, torch.Tensor] = {}  # layer -> (S, H_kv, T, D_k)
        self._values: dict[int, torch.Tensor] = {}  # layer -> (S, H_kv, T, D_v)
        self._plan: tuple = ()

    def plan_decode(
        self, positions: torch.Tensor, kv_length: int, slots: torch.Tensor | None = None, window_start: int = 0
    ) -> None:
        """Next forward feeds one token to each of `slots` (default 0..n-1), at positions (n,); attend over
        [0, kv_length), sliding layers over [window_start, kv_length). Slots other than 0..n-1 are read through a
        copy of those positions."""
        compact = slots is None
        if compact:
            slots = torch.arange(len(positions), device=positions.device)
        self._plan = ("decode", positions, slots, kv_length, compact, window_start)

    def plan_prefill(self, first_slot: int, num_rows: int, length: int) -> None:
        """Next forward feeds positions 0..length-1 of slots first_slot..first_slot+num_rows-1 (fresh requests)."""
        self._plan = ("prefill", first_slot, num_rows, length)

    def layer(self, layer_idx: int, key_like: torch.Tensor, value_like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The layer's (S, H_kv, T, D) key and value stores, allocated like these states (B, H_kv, q, D)."""
        if layer_idx not in self._keys:
            S, T = self.num_slots, self.max_context
            self._keys[layer_idx] = key_like.new_zeros(S, key_like.shape[1], T, key_like.shape[3])
            self._values[layer_idx] = value_like.new_zeros(S, value_like.shape[1], T, value_like.shape[3])
        return self._keys[layer_idx], self._values[layer_idx]

    def decode_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The planned decoding step's (slots, positions), each (n,): where row j's new key and value go."""
        _, positions, slots, *_ = self._plan
        return slots, positions

    def decode_read(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the planned decoding step's attention reads in this layer, once its keys and values are stored."""
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        _, _, slots, kv_length, compact, window_start = self._plan
        start = window_start if layer_idx in self.sliding_layers else 0
        if compact:
            n = len(slots)
            return keys[:n, :, start:kv_length], values[:n, :, start:kv_length]
        read = slice(start, kv_length)
        return keys[:, :, read].index_select(0, slots), values[:, :, read].index_select(0, slots)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's keys/values (B, H_kv, q, D) and return what attention should read."""
        keys, values = self.layer(layer_idx, key_states, value_states)
        if self._plan[0] == "decode":
            slots, positions = self.decode_rows()
            keys[slots, :, positions] = key_states[:, :, 0]  # (n, H_kv, D) into each slot at its own position
            values[slots, :, positions] = value_states[:, :, 0]
            return self.decode_read(layer_idx)
        _, first, num_rows, length = self._plan
        keys[first : first + num_rows, :, :length] = key_states
        values[first : first + num_rows, :, :length] = value_states
        # A fresh request attends only to its own prompt: exactly the states just computed.
        return key_states, value_states

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy slots src[i] -> dst[i] (positions [0, length)); used to keep running requests compact."""
        if not src or not self._keys:
            return
        device = next(iter(self._keys.values())).device
        src_t, dst_t = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        for store in (self._keys, self._values):
            for tensor in store.values():
                tensor[dst_t, :, :length] = tensor[src_t, :, :length]
