"""Causal language models: load any Hugging Face checkpoint, or build a small Qwen2-style one.

Both return a plain `transformers.PreTrainedModel`, so the trainer and the rollout engine run the
same model code. This module is not a model zoo and does no training or generation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2MoeConfig,
)

from flashreinforce.models.moe import check_moe_arguments, init_zero_routers

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
    num_experts: int = 0,
    experts_per_token: int = 2,
    moe_intermediate_size: int | None = None,
) -> PreTrainedModel:
    """A freshly initialised Qwen2-style causal LM (RoPE, RMSNorm, SwiGLU MLP, GQA-capable).

    Meant for tests and the default recipe (hidden 64-512). `intermediate_size` defaults to
    4 * hidden_size. The weights depend only on the arguments and `seed`; the global torch RNG is
    left untouched.

    `num_experts=0` (the default) builds the dense Qwen2 model. `num_experts >= 2` builds a Qwen2-MoE
    model instead (so MoE code paths such as router replay, see models/moe.py, can be tested on a small
    model): every layer sparse, `experts_per_token` routed experts per token with normalised top-k
    weights, plus one always-on shared expert of width hidden_size. Each routed expert's width
    `moe_intermediate_size` defaults to hidden_size, so the active MLP width (k experts + the shared
    one, 3 * hidden_size at k=2) stays near the dense model's 4 * hidden_size, as in released MoE
    models whose experts are narrower than the hidden size. Arguments that would have no effect are
    refused: `intermediate_size` with experts (no layer is dense), `moe_intermediate_size` without.
    `experts_per_token` is ignored for a dense model (its default cannot be told from a given value).
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
    check_moe_arguments(num_experts, experts_per_token, intermediate_size, moe_intermediate_size)
    shared = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "pad_token_id": pad_token_id,
        "eos_token_id": eos_token_id,
        "bos_token_id": None,
    }
    if num_experts:
        config = Qwen2MoeConfig(
            **shared,
            intermediate_size=4 * hidden_size,  # for dense layers only, and there are none
            num_experts=num_experts,
            num_experts_per_tok=experts_per_token,
            moe_intermediate_size=moe_intermediate_size or hidden_size,
            shared_expert_intermediate_size=hidden_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    else:
        config = Qwen2Config(**shared, intermediate_size=intermediate_size or 4 * hidden_size)
    # fork_rng: a model built in the middle of a run must not shift the run's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=resolve_dtype(dtype))
        init_zero_routers(model)
    return model


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """Load a causal LM saved with `save_pretrained` from a local directory (never the network); a folder with
    our vision encoder beside the LM (models/vision.py) loads as the VisionLM of both. `attn_implementation`
    None: sdpa, or eager for a family without sdpa (Gemma 2, GPT-OSS)."""
    from flashreinforce.models.hf_vision import is_hf_vision_dir, load_hf_vision_lm
    from flashreinforce.models.vision import is_vision_dir, load_vision_lm

    path = check_model_dir(path)
    if is_hf_vision_dir(path):
        return load_hf_vision_lm(path, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation or "sdpa")
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation, local_files_only=True
    )
    return load_vision_lm(path, model) if is_vision_dir(path) else model


def disable_dropout(model: torch.nn.Module) -> None:
    """Turn off a model's dropout in place: its nn.Dropout layers and the rate HF attention modules pass to
    their kernel in training mode. RL needs one policy: the engine samples without dropout (eval mode), so
    the trainer's recompute must use none either, or behavior and recomputed log-probs differ by noise
    (GPT-2's configs ship 0.1 everywhere; most others 0)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def model_dir_problem(path: Path) -> tuple[Path, str] | None:
    """(file, what is wrong with it) for the first unusable file of a saved model directory, or None.

    It checks what `from_pretrained` would otherwise trip over with a traceback: a missing directory or
    config.json, JSON files (config, tokenizer) that do not parse, safetensors files whose header does not
    cover the file (a truncated copy: safetensors checks the sizes when it opens one, a cheap mmap), shards
    named by an index that are absent, and no weights at all. It cannot see flipped bits inside tensor data.
    """
    if not path.is_dir():
        return path, "does not exist or is not a directory"
    if not (path / "config.json").is_file():
        return path / "config.json", "is missing"
    for file in sorted(path.glob("*.json")):
        try:
            json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:  # ValueError covers bad JSON and bad UTF-8
            return file, f"is not valid JSON ({error})"
    weights = sorted(path.glob("*.safetensors"))
    for file in weights:
        try:
            with safe_open(str(file), framework="pt") as handle:
                handle.keys()
        except (SafetensorError, OSError) as error:
            return file, f"is damaged or truncated ({error})"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))  # parsed above: valid JSON
        shards = sorted(set(weight_map.get("weight_map", {}).values())) if isinstance(weight_map, dict) else []
        absent = [name for name in shards if not (path / name).is_file()]
        if absent:
            return index, f"names shards that are missing ({', '.join(absent)})"
    if not weights and not any(path.glob("*.bin")):
        return path, "holds no weights (no *.safetensors or *.bin file)"
    return None


def check_model_dir(path: str | Path, *, field: str = "model path") -> Path:
    """`path` as a Path, or a ValueError naming `field`, the file and the fix (see model_dir_problem).

    Called before anything loads from the directory: the tokenizer loader, given a path that does not exist,
    would take it for a Hub repo id and fail with an OSError about the Hub.
    """
    path = Path(path)
    problem = model_dir_problem(path)
    if problem is None:
        return path
    file, what = problem
    if file == path and not path.is_dir():
        raise ValueError(
            f"{field} {str(path)!r} does not exist: it must be a local directory holding config.json and the "
            "weights, written by save_pretrained, or (model.path) a Hugging Face model id such as ORG/NAME"
        )
    name = "the directory" if file == path else file.name
    raise ValueError(f"{field} {str(path)!r}: {name} {what}; restore it from a backup or save the model again "
                     "with save_pretrained")
