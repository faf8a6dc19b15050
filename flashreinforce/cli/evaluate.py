"""`flashreinforce eval CHECKPOINT`: avg@k and unbiased pass@k of a saved model, per data_source."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from transformers import AutoTokenizer

from flashreinforce.cli.train import build_engine, load_data, read_run_config
from flashreinforce.config import config_from_tree, load_config
from flashreinforce.controller.local import LocalBackend
from flashreinforce.data.loaders import load_prompts
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.eval.evaluate import evaluate
from flashreinforce.models import load_model
from flashreinforce.models.causal_lm import model_dir_problem
from flashreinforce.trainer.checkpoint import latest_checkpoint
from flashreinforce.types import SamplingParams
from flashreinforce.verifiers.pool import VerifierPool


def resolve_model_dir(path: Path) -> tuple[Path, Path | None]:
    """(model directory, run directory or None) for a run dir, a checkpoints/step_* dir or a model dir."""
    if (path / "config.yaml").is_file():  # a run directory: its latest checkpoint, else its warm start
        checkpoint = latest_checkpoint(path / "checkpoints")
        model_dir = checkpoint / "model" if checkpoint is not None else path / "sft"
        return model_dir, path
    if (path / "model" / "config.json").is_file():  # checkpoints/step_N
        run_dir = path.parent.parent
        return path / "model", run_dir if (run_dir / "config.yaml").is_file() else None
    if (path / "config.json").is_file():
        run_dir = path.parent
        return path, run_dir if (run_dir / "config.yaml").is_file() else None
    raise ValueError(f"{path} is not a run directory, a checkpoint directory or a Hugging Face model directory")


def evaluate_checkpoint(
    path: Path,
    *,
    data: Path | None,
    recipe: str | None,
    k: int,
    num_prompts: int | None,
    temperature: float,
    top_p: float,
    max_new_tokens: int | None,
    seed: int,
    json_path: Path | None,
) -> dict:
    model_dir, run_dir = resolve_model_dir(Path(path))
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} holds no model yet (the run has no checkpoint and no warm start)")
    problem = model_dir_problem(model_dir)  # checked before the tokenizer: a damaged file is named, not a traceback
    if problem is not None:
        raise ValueError(f"cannot evaluate {model_dir}: {problem[0].name} {problem[1]}; restore it from a backup, "
                         "or evaluate an older checkpoint (pass its checkpoints/step_* directory)")
    config = config_from_tree(read_run_config(run_dir)) if run_dir is not None else load_config(recipe)
    prompts = load_prompts(data).prompts if data is not None else load_data(config).eval
    prompts = prompts[: num_prompts or config.eval.num_prompts]
    max_new_tokens = max_new_tokens or config.rollout.max_new_tokens
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = load_model(model_dir, dtype=config.model.dtype)
    episodes = TextEpisodes(tokenizer)
    engine = build_engine(
        model,
        tokenizer,
        max_batch_size=config.rollout.max_batch_size,
        max_new_tokens=max_new_tokens,
        longest_prompt=max(len(episodes.prompt_ids(p)) for p in prompts),
        seed=seed,
        version=0,
    )
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)

    async def run() -> dict:
        with VerifierPool([config.verifier.reward_fn], timeout_s=config.verifier.timeout_s,
                          memory_limit_mb=config.verifier.memory_limit_mb) as pool:
            backend = LocalBackend(engine, None, pool, tokenizer, overlap=False)
            report = await evaluate(backend, episodes, prompts, k=k, params=params, seed=seed)
            await backend.close()
        print(f"{model_dir}: {report.describe()}")
        return {"model": str(model_dir), **report.metrics(), "k": k, "num_prompts": len(prompts),
                "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens}

    result = asyncio.run(run())
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2))
    return result
