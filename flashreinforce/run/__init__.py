"""Run assembly: every command builds its run here, from a RunConfig, out of small builders.

    training.py    `train`: the whole job, in order (data, policy, parts, evals, loop, summary)
    sft.py         `sft`;  evaluation.py `eval`;  bench.py `bench`
    data.py        prompts;  policy.py  model + tokenizer (model.path, checkpoint, tiny model + SFT)
    engines.py     ENGINES by rollout.engine;  backends.py  BACKENDS by backend.kind, episodes by env.kind, the CPU pool
    learner.py     the trainer;  scheduling.py  the scheduler;  hooks.py  metrics, checkpoints, held-out eval
    directory.py   the run directory;  ahrl.py  pass rates and hinted prompts;  tables.py  kind -> builder
    preflight.py   `train --dry-run`: the resolved config, and the run's checks without a model or training

A new engine or backend is one builder in its table (an environment is a class: envs/protocol.py); this
package holds no policy of its own.
"""

import importlib
from typing import Any

_EXPORTS = {"EvalRequest": "evaluation", "evaluate_checkpoint": "evaluation", "run_training": "training",
            "sft_only": "sft"}
"""Imported on first use, so that `flashreinforce config` (run/config_reference.py) imports no torch."""

__all__ = ["EvalRequest", "evaluate_checkpoint", "run_training", "sft_only"]  # _EXPORTS' names


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
