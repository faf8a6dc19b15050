"""Models: load or build a causal LM, the character tokenizer, and per-token log-probs + entropies."""

from flashreinforce.models.causal_lm import build_model, load_model, resolve_dtype
from flashreinforce.models.logprobs import token_logprobs
from flashreinforce.models.tokenizer import build_char_tokenizer

__all__ = [
    "build_char_tokenizer",
    "build_model",
    "load_model",
    "resolve_dtype",
    "token_logprobs",
]
