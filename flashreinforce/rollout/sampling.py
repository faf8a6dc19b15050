"""Pure sampling math: logits -> processed log-probs -> one token per row, from a counter-based stream.

Nothing here knows about requests, caches or models; every function works on a batch of rows with
per-row settings, so the engine samples a whole decoding step with a few tensor ops.

Randomness is counter-based: token j of a request with stream key k is drawn with the uniform
u = hash(k, j). A request therefore samples the same tokens alone or in any batch, and a resumed
partial continues the exact stream of an uninterrupted run: the state is just (k, j). Keys are 32
bits, so two unrelated requests share a stream with probability 2**-32.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), split in 16-bit halves so nothing overflows int64."""
    low = x * (c & 0xFFFF)
    high = (x * (c >> 16)) & 0xFFFF
    return (low + (high << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash with full avalanche (Wellons' "lowbias32"), on int64 tensors."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_key(seed: int) -> int:
    """The 32-bit stream key of a request seed in [0, 2**64)."""
    low = mix32(torch.tensor([seed & _M32], dtype=torch.int64))
    return int(mix32(low ^ ((seed >> 32) & _M32)).item())


def counter_uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """u[b] = mix32(keys[b] + counters[b] * golden) / 2**32, in [0, 1). (B,) int64 -> (B,) float64.

    For one key the counters walk a Weyl sequence (distinct for 2**32 steps) that the full-avalanche
    mix turns into independent-looking uniforms (the splitmix construction, in 32 bits).
    """
    return mix32(keys + _mul32(counters, 0x9E3779B9)).double() / 2.0**32


def processed_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Log-probs of the distribution each row actually samples from.

        z = logits / T;  keep z_v >= (top_k-th largest z) when top_k > 0 (ties at the threshold stay);
        then keep v iff the probability mass of tokens ranked strictly above v is < top_p;
        result = log_softmax(z restricted to kept tokens), -inf elsewhere.
    Rows with T == 0 are greedy: a point mass on the first argmax of the logits (log-prob 0 there).
    logits (B, V) any float dtype; temperature, top_p (B,) float; top_k (B,) int64. Returns (B, V), at
    least fp32.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (B, V): at least fp32
    greedy = temperature == 0  # (B,)
    divisors = torch.where(greedy, 1.0, temperature.float())  # (B,)
    if bool((divisors != 1).any()):  # dividing by 1 changes no value: a pass over B x V spared at T = 1
        z = z / divisors[:, None]
    truncate_k, truncate_p = bool((top_k > 0).any()), bool((top_p < 1).any())
    if truncate_k or truncate_p:
        z = _truncate(z, top_k, top_p, truncate_p)
    logprobs = torch.log_softmax(z, dim=-1)  # (B, V)
    if bool(greedy.any()):
        point = torch.full_like(logprobs, float("-inf")).scatter_(1, z.argmax(-1, keepdim=True), 0.0)
        logprobs = torch.where(greedy[:, None], point, logprobs)
    return logprobs


def _truncate(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, truncate_p: bool) -> torch.Tensor:
    """Top-k then top-p on temperature-scaled logits z (B, V): removed entries become -inf."""
    V = z.shape[-1]
    sorted_z, order = z.sort(dim=-1, descending=True)  # (B, V)
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)  # (B,)
    kth = sorted_z.gather(1, (k - 1)[:, None])  # (B, 1)
    sorted_z = sorted_z.masked_fill(sorted_z < kth, float("-inf"))  # still sorted: top-k is a prefix
    if truncate_p:
        probs = torch.softmax(sorted_z, dim=-1)  # (B, V)
        mass_above = probs.cumsum(-1) - probs  # (B, V) mass of strictly higher-ranked tokens
        # p == 1 keeps everything explicitly: rounding can push mass_above of tail tokens to 1.0.
        drop = (mass_above >= top_p[:, None]) & (top_p < 1)[:, None]
        sorted_z = sorted_z.masked_fill(drop, float("-inf"))
    return torch.empty_like(z).scatter_(1, order, sorted_z)


CDF_BLOCK = 256
"""Tokens per block of the two-level inverse CDF in `sample`."""


def sample(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: token = first v with cdf[v] > u * cdf[V-1]. (B, V), (B,) -> (B,) int64.

    Zero-probability tokens have an empty CDF interval, so they are never drawn. The CDF is summed in fp64 (it
    keeps the tail intervals honest), in two levels so that only CDF_BLOCK tokens a row go through fp64 one by
    one: the blocks' masses locate the block holding u's token, a cumulative sum inside that block the token. A
    cumulative sum over the whole vocabulary in fp64 was a fifth of a decoding step on a 49k vocabulary.
    """
    B, V = logprobs.shape
    probs = logprobs.float().exp()  # (B, V); exp(-inf) = 0
    blocks = -(-V // CDF_BLOCK)
    if blocks * CDF_BLOCK != V:  # (padding copies the whole batch)
        probs = torch.nn.functional.pad(probs, (0, blocks * CDF_BLOCK - V))
    probs = probs.view(B, blocks, CDF_BLOCK)
    block_cdf = probs.sum(-1, dtype=torch.float64).cumsum(-1)  # (B, blocks)
    target = (uniforms * block_cdf[:, -1])[:, None]  # (B, 1)
    # The first block whose CDF passes the target: it has positive mass, and the CDF before it is <= target.
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=blocks - 1)  # (B, 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)  # (B, 1)
    inside = probs.gather(1, block[:, :, None].expand(B, 1, CDF_BLOCK)).squeeze(1)  # (B, CDF_BLOCK)
    cdf = before + inside.double().cumsum(-1)  # (B, CDF_BLOCK)
    offset = torch.searchsorted(cdf, target, right=True)  # (B, 1)
    # Summed in another order, the block's own CDF can end a rounding error short of the target: then the token
    # is the block's last possible one (never a zero-probability token after it).
    last_possible = CDF_BLOCK - 1 - (inside > 0).flip(-1).int().argmax(-1, keepdim=True)  # (B, 1)
    offset = torch.minimum(offset, last_possible)
    return (block * CDF_BLOCK + offset).squeeze(1).clamp_(max=V - 1)
