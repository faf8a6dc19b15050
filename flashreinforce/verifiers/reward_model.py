"""`reward_model`: a Hugging Face sequence-classification reward model scores (prompt, response).

The conversation is the prompt's chat messages (or its text as one user message) plus the response as the
assistant's turn, rendered with the reward model's own chat template when its tokenizer has one (else prompt and
response joined by a newline), truncated from the left to `max_length` tokens. The score is the logit of label 0
(reward models have one label; `label` picks another), optionally squashed: reward = sigmoid((score - shift) /
scale), or (score - shift) / scale with `squash: none`. `passed` is reward > `pass_threshold`.

The model is loaded once per verifier worker process, on `device` (CPU by default: the trainer and engines keep
the GPUs), in fp32 unless `dtype` says otherwise; rows are scored one call at a time, as every verifier in the
pool is. A path that is not a sequence-classification model is an error when the verifier is built.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashreinforce.types import Prompt, Verdict

SQUASHES = ("sigmoid", "none")


def reward_model_verifier(*, path: str, device: str = "cpu", dtype: str = "float32", max_length: int = 2048,
                          label: int = 0, squash: str = "sigmoid", shift: float = 0.0, scale: float = 1.0,
                          pass_threshold: float = 0.5) -> Callable[[str, str, Prompt], Verdict]:
    """Options: path (a local model directory), device, dtype, max_length, label, squash (sigmoid | none), shift,
    scale, pass_threshold."""
    if squash not in SQUASHES:
        raise ValueError(f"squash={squash!r} is not one of {SQUASHES}")
    if not scale > 0 or max_length < 8:
        raise ValueError(f"scale={scale} must be > 0 and max_length={max_length} at least 8")
    model, tokenizer = load_reward_model(path, device=device, dtype=dtype)
    if not 0 <= label < model.config.num_labels:
        raise ValueError(f"label={label}: the model at {path} has {model.config.num_labels} label(s)")

    def score(completion: str, ground_truth: str, prompt: Prompt) -> Verdict:
        raw = reward_score(model, tokenizer, conversation(prompt, completion), label=label, max_length=max_length)
        value = (raw - shift) / scale
        reward = 1.0 / (1.0 + math.exp(-value)) if squash == "sigmoid" else value
        passed = reward > pass_threshold
        return Verdict(reward=reward, passed=passed, reason="ok" if passed else "low_score")
    return score


def load_reward_model(path: str, *, device: str, dtype: str) -> tuple[Any, Any]:
    """The model and tokenizer of a local directory; anything else than a sequence-classification model is a
    ValueError naming the path and what it holds."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from flashreinforce.models.tokenizer import load_tokenizer

    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ValueError(f"path={path!r} is not a model directory (no config.json): save the reward model with "
                         "save_pretrained and give its directory")
    architectures = AutoConfig.from_pretrained(directory, local_files_only=True).architectures or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise ValueError(f"path={path!r} holds {architectures or 'a model of no stated architecture'}, not a "
                         "sequence-classification reward model (an ...ForSequenceClassification with a score head)")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r} is not one of float32, bfloat16, float16")
    model = AutoModelForSequenceClassification.from_pretrained(directory, local_files_only=True,
                                                               dtype=getattr(torch, dtype)).to(device).eval()
    tokenizer = load_tokenizer(directory)
    if model.config.pad_token_id is None:  # the score is read at the last non-pad token
        model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return model, tokenizer


def conversation(prompt: Prompt, completion: str) -> list[dict[str, str]]:
    messages = list(prompt.prompt) if isinstance(prompt.prompt, tuple) else [{"role": "user", "content": prompt.prompt}]
    return [*messages, {"role": "assistant", "content": completion}]


def reward_score(model: Any, tokenizer: Any, messages: list[dict[str, str]], *, label: int, max_length: int) -> float:
    """The model's logit of `label` for the conversation, its tokens cut from the left to max_length."""
    import torch

    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    else:
        ids = tokenizer.encode("\n".join(m["content"] for m in messages))
    ids = list(ids)[-max_length:]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits
    return float(logits[0, label].float())
