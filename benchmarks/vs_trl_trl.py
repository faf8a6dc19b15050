"""One TRL GRPOTrainer run of the vs-trl task, in the worker process vs_trl.py starts for it.

TRL gets what our GRPO recipe gets, mapped onto its documented options: the warm-start model and tokenizer
loaded from the shared directory, a plain-text `prompt` column ("37+485="), a reward function that decodes
the sampled ids the way our episodes do and calls our math verifier, 32 prompts x 4 generations = 128
completions and one optimizer step per generation batch, T=1 / top-p 1 / top-k off, 64 new tokens, AdamW
with a constant learning rate and the same clip, no KL (beta=0), loss_type="grpo" (the objective of our
GRPO), fp32 on the CPU, generating with `model.generate`. It generates and trains at the method's threads
(trl: --threads, trl-all-cores: all cores) and evaluates at --threads. Timing, token counts and held-out scores
come from one callback.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from vs_trl_task import RECIPES, EvalPoint, HeldOut, Settings, WorkerSpec, precision_overrides, task_overrides

from flashreinforce.run.data import load_data
from flashreinforce.run.policy import seed_everything
from flashreinforce.config import load_config
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.models import load_model
from flashreinforce.verifiers.math import math_reward


class SampledTokens:
    """TRL's reward function: our verifier on each completion; also counts the tokens TRL sampled.

    TRL hands over `completion_ids` cut after the first EOS (EOS included), the same tokens our engine
    counts. The text is decoded as our episodes decode it (EOS and padding dropped, special tokens kept),
    so both frameworks score identical strings.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.__name__ = "math"  # TRL names reward columns after the function
        self.tokenizer = tokenizer
        self.drop = {tokenizer.eos_token_id, tokenizer.pad_token_id}
        self.count = 0

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                 ground_truth: list[str], **_: Any) -> list[float]:
        self.count += sum(len(ids) for ids in completion_ids)
        texts = [self.tokenizer.decode([t for t in ids if t not in self.drop], skip_special_tokens=False)
                 for ids in completion_ids]
        return [math_reward(text, truth).reward for text, truth in zip(texts, ground_truth)]


class Clock(TrainerCallback):
    """RL wall-clock from the start of the first step, with the held-out evaluations cut out of it."""

    def __init__(self, held_out: HeldOut, tokens: SampledTokens, *, every: int, max_seconds: float) -> None:
        self.held_out = held_out
        self.tokens = tokens
        self.every = every
        self.max_seconds = max_seconds
        self.points: list[EvalPoint] = []
        self.seconds = 0.0
        self.eval_seconds = 0.0
        self.started = 0.0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.points.append(EvalPoint(0, 0.0, 0, self.held_out(model, 0), 0))
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        now = time.perf_counter()
        self.seconds = now - self.started - self.eval_seconds
        over = self.seconds >= self.max_seconds
        if state.global_step % self.every == 0 or state.global_step >= state.max_steps or over:
            accuracy = self.held_out(model, state.global_step)
            # One optimizer step per generation batch, generated just before it: all it sampled, it trained on.
            self.points.append(EvalPoint(state.global_step, self.seconds, self.tokens.count, accuracy,
                                         trained_tokens=self.tokens.count))
            self.eval_seconds += time.perf_counter() - now
        if over:  # never reset the flag: TRL's own callback sets it at max_steps
            control.should_training_stop = True


def grpo_args(settings: Settings, seed: int, run_dir: str, **options: Any) -> GRPOConfig:
    """The task's settings as TRL's options; `options` adds or overrides some (vs_trl_routes.py's routes)."""
    return GRPOConfig(**{
        "output_dir": run_dir,
        "seed": seed,
        "use_cpu": True,
        "bf16": settings.precision == "bf16",  # autocast of the training forward; TRL generates in fp32
        "gradient_checkpointing": False,
        "per_device_train_batch_size": settings.trajectories,
        "gradient_accumulation_steps": 1,  # one optimizer step per generation batch
        "num_generations": settings.group_size,
        "max_completion_length": settings.max_new_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "learning_rate": settings.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": settings.grad_clip,
        "beta": 0.0,
        "loss_type": "grpo",
        "max_steps": settings.steps,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        **options,
    })


def prompt_dataset(prompts: list[Any]) -> Dataset:
    """TRL's train set: the plain-text prompts and, for the reward function, their answers."""
    return Dataset.from_dict({"prompt": [p.prompt for p in prompts], "ground_truth": [p.ground_truth for p in prompts]})


def check_same_tokens(trainer: Any, tokenizer: Any, prompts: list[Any]) -> None:
    """TRL must see the prompts as our engine does and stop where it stops."""
    episodes = TextEpisodes(tokenizer)
    for prompt in prompts[:64]:
        theirs = trainer.processing_class(text=[prompt.prompt])["input_ids"][0]
        assert list(theirs) == episodes.prompt_ids(prompt), \
            f"TRL tokenizes {prompt.prompt!r} as {theirs}, our engine as {episodes.prompt_ids(prompt)}"
    assert trainer.eos_token_ids == [tokenizer.eos_token_id], f"TRL stops on {trainer.eos_token_ids}"


def run_trl(spec: WorkerSpec) -> None:
    settings = spec.settings
    torch.set_num_threads(settings.trl_threads(spec.method))  # held-out evaluation switches to settings.threads
    config = load_config(RECIPES["grpo"], [*task_overrides(settings), *precision_overrides(settings)])
    seed_everything(spec.seed)
    data = load_data(config)
    tokenizer = AutoTokenizer.from_pretrained(spec.warm_dir, local_files_only=True)
    model = load_model(spec.warm_dir, dtype="float32")
    held_out = HeldOut(model, tokenizer, config, data.eval[: settings.eval_prompts], spec.seed)
    tokens = SampledTokens(tokenizer)
    clock = Clock(held_out, tokens, every=settings.eval_every, max_seconds=settings.max_seconds)
    trainer = GRPOTrainer(model=model, reward_funcs=tokens, args=grpo_args(settings, spec.seed, spec.run_dir),
                          train_dataset=prompt_dataset(data.train), processing_class=tokenizer, callbacks=[clock])
    trainer.remove_callback(PrinterCallback)  # per-step log dicts on stdout; the log history keeps them
    check_same_tokens(trainer, tokenizer, data.train)
    trainer.train()
    held_out.close()
    result = {
        "points": [asdict(p) for p in clock.points],
        "steps": trainer.state.global_step,
        "seconds": clock.seconds,
        "sampled_tokens": tokens.count,
        "eval_seconds": clock.eval_seconds,
        "threads": torch.get_num_threads(),
        "rewards": [row["reward"] for row in trainer.state.log_history if "reward" in row],
    }
    (Path(spec.run_dir) / "result.json").write_text(json.dumps(result, indent=2))
