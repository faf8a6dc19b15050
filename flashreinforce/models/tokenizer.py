"""A character-level tokenizer for synthetic tasks, saved and loaded like any Hugging Face tokenizer.

One token per character of the alphabet, plus whole-word special tokens (`<think>` is one token).
It is built with the `tokenizers` library and wrapped as a fast tokenizer, so `save_pretrained`
writes a tokenizer.json that `PreTrainedTokenizerFast.from_pretrained(dir)` reads with no custom code (beside a
model's config.json, transformers 5's AutoTokenizer picks the model type's tokenizer class instead: see
load_tokenizer):
runs and checkpoints stay self-contained.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

DEFAULT_SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>", "<think>", "</think>")


def build_char_tokenizer(
    alphabet: str,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    *,
    pad_token: str = "<pad>",
    eos_token: str = "<eos>",
    unk_token: str = "<unk>",
) -> PreTrainedTokenizerFast:
    """Ids 0..len(special_tokens)-1 are the special tokens in order, then one id per alphabet character.

    pad, eos and unk are "special" in the Hugging Face sense (`skip_special_tokens=True` drops
    them when decoding); the other special tokens (`<think>`, `</think>`) stay in decoded text,
    because verifiers read them. A character outside the alphabet encodes to `unk_token`, so it
    shows up instead of vanishing. No BOS/EOS is added on encode: the caller decides.
    """
    chars = list(alphabet)
    if not chars:
        raise ValueError("alphabet is empty: pass the characters the task uses, e.g. '0123456789+=;'")
    repeated = sorted({c for c in chars if chars.count(c) > 1})
    if repeated:
        raise ValueError(f"alphabet repeats characters {repeated}: list each character once")
    if len(set(special_tokens)) != len(special_tokens):
        raise ValueError(f"special_tokens {list(special_tokens)} has duplicates")
    clashes = sorted(set(special_tokens) & set(chars))
    if clashes:
        raise ValueError(f"special tokens {clashes} are also alphabet characters: drop them from one of the two")
    for role, token in (("pad_token", pad_token), ("eos_token", eos_token), ("unk_token", unk_token)):
        if token not in special_tokens:
            raise ValueError(f"{role}={token!r} is not in special_tokens {list(special_tokens)}")

    vocab = {token: i for i, token in enumerate([*special_tokens, *chars])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk_token))
    # Every character is its own word; "(?m)" lets "." match a newline too (Oniguruma syntax).
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    backend.decoder = decoders.Fuse()  # join tokens without spaces
    roles = {pad_token, eos_token, unk_token}
    # Added tokens are matched before the per-character split, which keeps "<think>" one token.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens if t in roles])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in special_tokens if t not in roles])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=pad_token,
        eos_token=eos_token,
        unk_token=unk_token,
        padding_side="right",
    )


def load_tokenizer(path: str | Path) -> Any:
    """The directory's tokenizer. A plain tokenizer.json one (our character tokenizers) loads as itself:
    transformers 5's AutoTokenizer would pick the model type's class (Qwen2Tokenizer beside a qwen2
    config.json), whose byte-level pre-tokenizer drops spaces and newlines from such a vocabulary."""
    from transformers import AutoTokenizer

    config_file = Path(path) / "tokenizer_config.json"
    tokenizer_class = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
    if tokenizer_class in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
