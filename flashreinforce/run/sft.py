"""`flashreinforce sft`: the warm start alone, saved to OUTPUT/sft, then its held-out accuracy."""

from __future__ import annotations

from pathlib import Path

import torch

from flashreinforce.config import RunConfig, dump_config
from flashreinforce.metrics.console import Reporter
from flashreinforce.run.data import load_data
from flashreinforce.run.evaluation import EvalRequest, evaluate_checkpoint
from flashreinforce.run.policy import build_policy, seed_everything


def sft_only(config: RunConfig, output: Path) -> Path:
    if config.model.path is not None:
        raise ValueError("sft warm-starts a model built from scratch; unset model.path")
    if config.sft.steps == 0:
        raise ValueError("sft.steps is 0: nothing to do")
    output.mkdir(parents=True, exist_ok=True)
    (output / "config.yaml").write_text(dump_config(config))
    seed_everything(config.seed)
    torch.set_num_threads(config.backend.torch_threads)
    build_policy(config, load_data(config), output, Reporter(enabled=config.log.progress))
    evaluate_checkpoint(EvalRequest(output / "sft", k=config.eval.k, temperature=config.eval.temperature,
                                    top_p=config.eval.top_p, seed=config.seed, json_path=output / "sft_eval.json"))
    return output / "sft"
