"""`trainer.device` / `rollout.device` -> a torch.device, with an error naming the field when it cannot be had."""

from __future__ import annotations

import torch

from flashreinforce.trainer.distributed import rank_gpu


def resolve_device(field: str, setting: str, *, rank: int = 0) -> torch.device:
    """auto: cuda when a GPU is visible, else cpu. A data-parallel rank on GPUs takes GPU `rank` (mod count)."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"{field}=cuda but torch sees no GPU (torch {torch.__version__}, CUDA build: "
                         f"{torch.version.cuda or 'no'}); install a CUDA build of torch or set {field}=cpu")
    return rank_gpu(rank)
