"""`trainer.device` / `rollout.device` -> a torch.device, with an error naming the field when it cannot be had; and
whether the overlapped loop's torch threads oversubscribe the cores."""

from __future__ import annotations

import os

import torch

from flashreinforce.config import RunConfig
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


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def thread_oversubscription(config: RunConfig, cores: int) -> str | None:
    """Why the overlapped loop's CPU threads exceed the cores, or None. Its engine thread and its trainer each run
    backend.torch_threads: each thread that runs torch's parallel kernels keeps an OpenMP team of its own. Once a
    process's OpenMP threads outnumber its cores, libgomp spins its idle threads 100 times between kernels instead
    of for up to milliseconds, so every small kernel waits for its helpers to wake (docs/benchmarks.md measures it
    on a bf16 SmolLM2 trainer step)."""
    threads = config.backend.torch_threads
    on_cpu = all(setting == "cpu" or (setting == "auto" and not torch.cuda.is_available())
                 for setting in (config.trainer.device, config.rollout.device))
    backend = config.backend
    one_process = backend.kind == "local" and config.trainer.world_size == 1 and not backend.trainer_process
    if config.deterministic or not one_process or not on_cpu:  # elsewhere each process has an OpenMP of its own
        return None
    if 2 * threads <= cores:
        return None
    return (f"backend.torch_threads={threads} in the overlapped loop: the engine's thread and the trainer each run "
            f"{threads} torch threads, {2 * threads} on {cores} cores, and past the cores OpenMP stops keeping its "
            "idle threads awake between kernels, so every small kernel waits for them (a bf16 trainer step ~10-15% "
            f"slower, on either thread). Set backend.torch_threads={max(1, cores // 2)}, or deterministic=true "
            "(lockstep: one side computes at a time, with every core)")
