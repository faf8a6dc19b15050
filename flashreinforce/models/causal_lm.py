"""Causal language models: load any Hugging Face checkpoint, or build a small Qwen2-style one.

Both return a plain `transformers.PreTrainedModel`, so the trainer and the rollout engine run the
same model code. This module is not a model zoo and does no training or generation.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2Config

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or one of the names in DTYPES (no silent fallback)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def build_model(
    vocab_size: int,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    max_position_embeddings: int = 256,
    *,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = True,
    pad_token_id: int | None = None,
    eos_token_id: int | None = None,
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
) -> PreTrainedModel:
    """A freshly initialised Qwen2-style causal LM (RoPE, RMSNorm, SwiGLU MLP, GQA-capable).

    Meant for tests and the default recipe (hidden 64-512). `intermediate_size` defaults to
    4 * hidden_size. The weights depend only on the arguments and `seed`; the global torch RNG is
    left untouched.
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size}: need at least 2 tokens")
    if hidden_size % num_heads or (hidden_size // num_heads) % 2:
        raise ValueError(
            f"hidden_size={hidden_size} must split into num_heads={num_heads} heads of even size (RoPE rotates pairs)"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    for name, token_id in (("pad_token_id", pad_token_id), ("eos_token_id", eos_token_id)):
        if token_id is not None and not 0 <= token_id < vocab_size:
            raise ValueError(f"{name}={token_id} is outside the vocabulary [0, {vocab_size})")
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
    )
    # fork_rng: a model built in the middle of a run must not shift the run's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=resolve_dtype(dtype))
    return model


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """Load a causal LM saved with `save_pretrained` from a local directory (never the network)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model path {str(path)!r} has no config.json: pass a local directory written by save_pretrained"
        )
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation, local_files_only=True
    )
