"""`reward_model`: a Hugging Face sequence-classification reward model scores (prompt, response).

The conversation is the prompt's chat messages (or its text as one user message) plus the response as the
assistant's turn, rendered with the reward model's own chat template when its tokenizer has one (else prompt and
response joined by a newline), truncated from the left to `max_length` tokens. The response's text is tokenized
as plain text (verifiers/fence.py): a response that writes its template's end-of-turn marker cannot end its turn
and speak as another role. The score is the logit of label 0
(reward models have one label; `label` picks another), optionally squashed: reward = sigmoid((score - shift) /
scale), or (score - shift) / scale with `squash: none`. `passed` is reward > `pass_threshold`.

The model is loaded once per verifier worker process, on `device` (CPU by default: the trainer and engines keep
the GPUs), in fp32 unless `dtype` says otherwise. It is batchable: the pool sends up to `batch_size` rows at once,
scored in one right-padded forward (a row's score is read at its last token, as when it is scored alone). A path
that is not a sequence-classification model is an error when the verifier is built.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flashreinforce.types import Prompt, Verdict
from flashreinforce.verifiers.fence import SLOT, tokens_around
from flashreinforce.verifiers.registry import DEFAULT_BATCH_SIZE, BatchedRewardFn, check_batch_size

SQUASHES = ("sigmoid", "none")


def reward_model_verifier(*, path: str, device: str = "cpu", dtype: str = "float32", max_length: int = 2048,
                          label: int = 0, squash: str = "sigmoid", shift: float = 0.0, scale: float = 1.0,
                          pass_threshold: float = 0.5, batch_size: int = DEFAULT_BATCH_SIZE) -> BatchedRewardFn:
    """Options: path (a local model directory), device, dtype, max_length, label, squash (sigmoid | none), shift,
    scale, pass_threshold, batch_size (rows per forward)."""
    if squash not in SQUASHES:
        raise ValueError(f"squash={squash!r} is not one of {SQUASHES}")
    if not scale > 0 or max_length < 8:
        raise ValueError(f"scale={scale} must be > 0 and max_length={max_length} at least 8")
    check_batch_size(batch_size)
    model, tokenizer = load_reward_model(path, device=device, dtype=dtype)
    if not 0 <= label < model.config.num_labels:
        raise ValueError(f"label={label}: the model at {path} has {model.config.num_labels} label(s)")

    def verdict(raw: float) -> Verdict:
        value = (raw - shift) / scale
        reward = 1.0 / (1.0 + math.exp(-value)) if squash == "sigmoid" else value
        passed = reward > pass_threshold
        return Verdict(reward=reward, passed=passed, reason="ok" if passed else "low_score")

    def score_batch(completions: Sequence[str], ground_truths: Sequence[str],
                    prompts: Sequence[Prompt]) -> list[Verdict]:
        rows = [conversation_ids(tokenizer, conversation(prompt, SLOT), max_length, completion)
                for completion, prompt in zip(completions, prompts)]
        return [verdict(raw) for raw in reward_scores(model, rows, label=label)]
    return BatchedRewardFn(score_batch, batch_size)


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


def conversation_ids(tokenizer: Any, messages: list[dict[str, str]], max_length: int, response: str) -> list[int]:
    """The conversation's tokens (its chat template's, else its contents joined by newlines), fence.SLOT in it
    replaced by the response's tokens (plain text), cut from the left to max_length."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    else:
        text = "\n".join(m["content"] for m in messages)
    return tokens_around(tokenizer, text, response)[-max_length:]


def reward_scores(model: Any, rows: Sequence[list[int]], *, label: int) -> list[float]:
    """The model's logit of `label` for each row of tokens, in one forward. Rows are padded on the right with the
    pad id, masked out: the model reads each row's score at its rightmost non-pad token, the one it reads when
    the row is alone, and a causal model's real tokens never attend to the pads after them."""
    import torch

    width, pad = max(len(ids) for ids in rows), model.config.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids in rows], device=model.device)
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in rows], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask).logits
    return [float(value) for value in logits[:, label].float()]
