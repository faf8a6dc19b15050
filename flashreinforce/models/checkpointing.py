"""Activation checkpointing of a transformers model's decoder layers, under either name transformers gave it."""

from __future__ import annotations

import torch


def checkpoint_layers(model: torch.nn.Module, kwargs: dict | None = None) -> None:
    """transformers' own activation checkpointing of each decoder layer, with `kwargs` for torch's checkpoint.
    transformers 5.24 renamed gradient_checkpointing_enable (the old name now warns); earlier 5.x has only it."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
