"""The policy a run starts from: a Hugging Face model directory, a checkpoint, or the tiny model warm-started
by SFT (cached in the run directory, so a resumed run does not redo it)."""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashreinforce.config import RunConfig
from flashreinforce.metrics.console import Reporter
from flashreinforce.models import build_char_tokenizer, build_model, load_model
from flashreinforce.models.tokenizer import load_tokenizer
from flashreinforce.models.causal_lm import check_model_dir
from flashreinforce.models.vision import IMAGE_TOKEN, build_vision_lm
from flashreinforce.models.numerics import Numerics
from flashreinforce.run.agent_demos import agent_examples, agent_template
from flashreinforce.run.data import Data
from flashreinforce.run.models import model_path
from flashreinforce.run.tasks import TASKS, tiny_vision_config
from flashreinforce.trainer.sft import sft_warm_start


@dataclass(frozen=True)
class Policy:
    tokenizer: Any
    model: Any
    """A transformers PreTrainedModel: the trainer trains it, each engine gets its own copy."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_policy(path: str | Path, *, field: str = "model path") -> Policy:
    """Tokenizer and fp32 model of a local Hugging Face directory (never the network). fp32: the trainer's
    masters start from it exactly, and each side casts and formats its own copy (side_numerics)."""
    # Checked first: the tokenizer loader takes a path that does not exist for a Hub repo id.
    path = check_model_dir(path, field=field)
    return Policy(load_tokenizer(path), load_model(path, dtype=torch.float32))


def pretrained_policy(config: RunConfig) -> Policy:
    """model.path's model and tokenizer, wherever it names them (resolve_model_path)."""
    return load_policy(resolve_model_path(config.model.path), field="model.path")


def resolve_model_path(path: str) -> Path:
    """model.path as a directory: a path; the name of a model `flashreinforce models get` converted (a recipe
    cannot know where a user's cache is; a known name whose conversion is missing is an error naming the
    command that makes it); or a Hugging Face model id, fetched into the Hugging Face cache (models/hub.py)."""
    from flashreinforce.models import hub, store

    if path in store.KNOWN_MODELS and not Path(path).exists():
        return model_path(path, None, field="model.path")
    if hub.is_hub_id(path):
        return hub.fetch_hub_model(path, field="model.path")
    return Path(path)


def side_numerics(config: RunConfig, side: str) -> Numerics:
    """The weight format and compute dtype of `side` ("trainer" or "rollout") from config.precision."""
    precision = config.precision
    return Numerics(precision=getattr(precision, side), unified=precision.mode == "unified",
                    fp8_scaling=precision.fp8_scaling, fp8_block=precision.fp8_block)


def build_policy(config: RunConfig, data: Data, run_dir: Path, reporter: Reporter) -> Policy:
    """The policy at the start of RL: model.path, or the tiny model after its SFT warm start.

    The warm start is saved to run_dir/sft/ once complete and reused from there.
    """
    if config.model.path is not None:
        return pretrained_policy(config)
    sft_dir = run_dir / "sft"
    if (sft_dir / "config.json").is_file():
        reporter.note(f"warm start: reusing {sft_dir}")
        return load_policy(sft_dir)
    policy = tiny_policy(config)
    if config.sft.steps:
        warm_start(config, data, policy, reporter)
    save_policy(policy, sft_dir)
    return policy


def save_policy(policy: Policy, directory: Path) -> None:
    """Model and tokenizer as a Hugging Face directory, whole or not at all (staged, then renamed). A directory there
    already is replaced (a stage redone after a kill saves again where its first try saved), as is what a kill left
    of an earlier staging."""
    staging, replaced = (directory.with_name(f"{directory.name}.{suffix}") for suffix in ("tmp", "replaced"))
    for leftover in (staging, replaced):
        shutil.rmtree(leftover, ignore_errors=True)
    policy.model.save_pretrained(staging, safe_serialization=True)
    policy.tokenizer.save_pretrained(staging)
    if directory.exists():  # os.replace cannot replace a non-empty directory: move it aside first
        os.replace(directory, replaced)
    os.replace(staging, directory)
    shutil.rmtree(replaced, ignore_errors=True)


def tiny_policy(config: RunConfig, kinds: Sequence[str] | None = None) -> Policy:
    """The task's characters, one token each, plus its tags as single special tokens; a small Qwen2-style
    model of model.tiny's shape. `kinds`: the data kinds its tokenizer must hold (default: the run's tasks')."""
    tokenizer = tiny_tokenizer(config, kinds)
    tiny = config.model.tiny
    model = build_model(len(tokenizer), tiny.hidden_size, tiny.num_layers, tiny.num_heads,
                        tiny.max_position_embeddings, pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=tokenizer.eos_token_id, seed=config.seed, num_experts=tiny.num_experts,
                        experts_per_token=tiny.experts_per_token)
    vision = tiny_vision_config(config, tokenizer)
    if vision is not None:
        model = build_vision_lm(model, vision, seed=config.seed)
    return Policy(tokenizer, model)


def tiny_tokenizer(config: RunConfig, kinds: Sequence[str] | None = None) -> Any:
    """The characters and tag tokens of every built-in task the run trains (in a mixture, all of theirs), or
    of the given data kinds."""
    kinds = list(dict.fromkeys(kinds or [task.data.kind for _, task in config.task_list()]))
    alphabet = "".join(dict.fromkeys("".join(TASKS[kind].alphabet for kind in kinds)))
    vision = (IMAGE_TOKEN,) if config.model.tiny.vision is not None else ()
    special = tuple(dict.fromkeys([*(token for kind in kinds for token in TASKS[kind].special_tokens), *vision]))
    return build_char_tokenizer(alphabet, special_tokens=("<pad>", "<eos>", "<unk>", *special))


def warm_start(config: RunConfig, data: Data, policy: Policy, reporter: Reporter) -> None:
    """SFT on the task's imperfect demonstrations (run/tasks.py); in a mixture, on every task's together. An agent
    task (env.kind=agent) whose data kind demonstrates answers to an agent's calls trains on its agent's own
    episodes, answered so (run/agent_demos.py), and the model then keeps the chat template they were rendered with;
    on another kind, on that kind's traces."""
    tokenizer = policy.tokenizer
    examples = []
    for name, task in config.task_list():
        train = data.by_task[name][0] if data.by_task else data.train
        kind = TASKS[task.data.kind]
        if task.env.is_agent and kind.demonstrate is not None:
            started = time.perf_counter()
            demonstrations = agent_examples(config.for_task(name), tokenizer, train, kind.demonstrate,
                                            getattr(policy.model.config, "max_position_embeddings", None))
            reporter.note(f"warm start: {len(demonstrations)} rows of demonstrated agent episodes "
                          f"in {time.perf_counter() - started:.0f} s")
            examples += demonstrations
        else:
            examples += kind.sft_examples(config.for_task(name), tokenizer, train)
    started = time.perf_counter()
    with reporter.task("SFT warm start", total=config.sft.steps) as advance:
        sft_warm_start(policy.model, examples, steps=config.sft.steps, batch_size=config.sft.batch_size,
                       lr=config.sft.lr, seed=config.seed, pad_token_id=tokenizer.pad_token_id,
                       on_step=lambda step, loss: advance(f"loss {loss:.3f}"),
                       numerics=side_numerics(config, "trainer"))
    reporter.note(f"warm start: {config.sft.steps} SFT steps in {time.perf_counter() - started:.0f} s")
    template = agent_template(config)
    if template is not None:
        tokenizer.chat_template = template
