"""`flashreinforce train`: builds every component from a RunConfig and runs the whole job.

    data -> tokenizer + model (built, or loaded) -> SFT warm start (built models) -> held-out eval
    -> RL loop (controller/loop.py) with checkpoints -> held-out eval -> summary.json, plots

A run directory holds config.yaml, metrics.jsonl, samples.jsonl, tensorboard/, plots/, checkpoints/,
sft/ (the warm-start model), initial_eval.json and summary.json. `resume_dir` continues a run from its
latest complete checkpoint with the same data order and in-flight partial rollouts.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
import yaml

from flashreinforce.algorithms.dapo import dynamic_sampling_keep
from flashreinforce.algorithms.passk import pass_at_k
from flashreinforce.buffer import build_scheduler, scheduler_options
from flashreinforce.config import RunConfig, dump_config
from flashreinforce.cli.console import Reporter
from flashreinforce.controller.local import LocalBackend
from flashreinforce.controller.loop import LoopSettings, RLLoop
from flashreinforce.data.arithmetic import ALPHABET, THINK_CLOSE, THINK_OPEN, make_arithmetic_splits, render_target
from flashreinforce.data.loaders import load_prompts
from flashreinforce.data.order import PromptOrder
from flashreinforce.envs.hints import HintedPrompts, longest_hinted_prompt
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.eval.evaluate import EvalReport, evaluate
from flashreinforce.metrics.plots import plot_run
from flashreinforce.metrics.sink import MetricsSink
from flashreinforce.models import build_char_tokenizer, build_model, load_model
from flashreinforce.rollout.engine import Engine
from flashreinforce.trainer.checkpoint import newest_intact_checkpoint, save_checkpoint
from flashreinforce.trainer.process import TrainerProcess
from flashreinforce.trainer.sft import sft_warm_start
from flashreinforce.trainer.trainer import OptimizerSettings, OverlongShaping, Trainer, WPSMSettings
from flashreinforce.types import Prompt, SamplingParams, Trajectory
from flashreinforce.verifiers.pool import VerifierPool

# Our own progress display is enough; transformers would add a bar for every checkpoint it writes.
transformers.utils.logging.disable_progress_bar()


@dataclass(frozen=True)
class Data:
    train: list[Prompt]
    eval: list[Prompt]
    skipped_rows: int


def default_run_dir(config: RunConfig) -> Path:
    return Path("runs") / f"{config.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def load_data(config: RunConfig) -> Data:
    if config.data.kind == "arithmetic":
        settings = config.data.arithmetic
        splits = make_arithmetic_splits(
            settings.num_train, settings.num_eval, seed=settings.seed, digit_weights=settings.digit_weights
        )
        return Data(train=splits.train, eval=splits.eval, skipped_rows=0)
    train = load_prompts(config.data.train, on_bad_row=config.data.on_bad_row)
    held_out = load_prompts(config.data.eval, on_bad_row=config.data.on_bad_row)
    return Data(train=train.prompts, eval=held_out.prompts, skipped_rows=len(train.skipped) + len(held_out.skipped))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    staging = path.with_suffix(path.suffix + ".tmp")
    staging.write_text(json.dumps(payload, indent=2))
    os.replace(staging, path)


def build_policy(config: RunConfig, data: Data, run_dir: Path, reporter: Reporter) -> tuple[Any, Any]:
    """(tokenizer, model) at the start of RL: loaded from model.path, or built and warm-started by SFT.

    The warm start is saved to run_dir/sft/ once complete, so a resumed run does not redo it.
    """
    dtype = config.model.dtype
    if config.model.path is not None:
        from transformers import AutoTokenizer

        from flashreinforce.models.causal_lm import check_model_dir

        # Checked first: the tokenizer loader takes a path that does not exist for a Hub repo id.
        path = check_model_dir(config.model.path, field="model.path")
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return tokenizer, load_model(path, dtype=dtype)
    sft_dir = run_dir / "sft"
    if (sft_dir / "config.json").is_file():
        from transformers import AutoTokenizer

        reporter.note(f"warm start: reusing {sft_dir}")
        return AutoTokenizer.from_pretrained(sft_dir), load_model(sft_dir, dtype=dtype)
    # The task's characters, one token each, plus the think tags as single special tokens.
    tokenizer = build_char_tokenizer("".join(c for c in ALPHABET if c not in (THINK_OPEN, THINK_CLOSE)),
                                     special_tokens=("<pad>", "<eos>", "<unk>", THINK_OPEN, THINK_CLOSE))
    tiny = config.model.tiny
    model = build_model(
        len(tokenizer),
        tiny.hidden_size,
        tiny.num_layers,
        tiny.num_heads,
        tiny.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype=dtype,
        seed=config.seed,
    )
    if config.sft.steps:
        episodes = TextEpisodes(tokenizer)
        rng = random.Random(config.seed)
        examples = [
            (
                episodes.prompt_ids(item),
                [*tokenizer.encode(render_target(item, carry_drop=config.sft.carry_drop, rng=rng),
                                   add_special_tokens=False), tokenizer.eos_token_id],
            )
            for item in data.train
        ]
        started = time.perf_counter()
        with reporter.task("SFT warm start", total=config.sft.steps) as advance:
            sft_warm_start(
                model,
                examples,
                steps=config.sft.steps,
                batch_size=config.sft.batch_size,
                lr=config.sft.lr,
                seed=config.seed,
                pad_token_id=tokenizer.pad_token_id,
                on_step=lambda step, loss: advance(f"loss {loss:.3f}"),
            )
        reporter.note(f"warm start: {config.sft.steps} SFT steps in {time.perf_counter() - started:.0f} s")
    staging = run_dir / "sft.tmp"
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    os.replace(staging, sft_dir)
    return tokenizer, model


def build_trainer(config: RunConfig, model: Any, tokenizer: Any) -> Trainer:
    algo, trainer = config.algo, config.trainer
    return Trainer(
        model,
        loss=algo.loss,
        loss_options=algo.options,
        optimizer=OptimizerSettings(
            lr=trainer.lr,
            weight_decay=trainer.weight_decay,
            betas=tuple(trainer.betas),
            warmup_steps=trainer.warmup_steps,
            total_steps=trainer.steps,
            min_lr_ratio=trainer.min_lr_ratio,
            grad_clip=trainer.grad_clip,
        ),
        microbatch_size=trainer.microbatch_size,
        microbatch_tokens=trainer.microbatch_tokens,
        pad_token_id=tokenizer.pad_token_id,
        temperature=config.rollout.temperature,
        max_new_tokens=config.rollout.max_new_tokens,
        overlong=OverlongShaping(algo.overlong.max_length, algo.overlong.cache) if algo.overlong else None,
        wpsm=WPSMSettings(algo.wpsm.tau, algo.wpsm.eta, algo.wpsm.alpha, algo.wpsm.positive_only) if algo.wpsm else None,
    )


def start_trainer(config: RunConfig, model: Any, tokenizer: Any) -> Trainer | TrainerProcess:
    """The run's trainer: in a process of its own when backend.trainer_process is set (overlapped loop only)."""
    if config.deterministic or not config.backend.trainer_process:
        return build_trainer(config, model, tokenizer)
    return TrainerProcess(build_trainer, (config, model, tokenizer), template=model.state_dict(),
                          threads=config.backend.torch_threads)


def build_engine(model: Any, tokenizer: Any, *, max_batch_size: int, max_new_tokens: int, longest_prompt: int,
                 seed: int, version: int) -> Engine:
    """The engine gets its own copy of the weights; its context is what the data actually needs."""
    needed = longest_prompt + max_new_tokens
    limit = getattr(model.config, "max_position_embeddings", needed)
    if needed > limit:
        raise ValueError(f"prompts of up to {longest_prompt} tokens (AHRL hints included) plus "
                         f"max_new_tokens={max_new_tokens} need {needed} positions but the model has {limit}; "
                         "lower rollout.max_new_tokens or algo.hints.p_initial, or use a model with a longer context")
    return Engine(
        copy.deepcopy(model),
        max_batch_size=max_batch_size,
        max_context=needed,
        eos_token_ids=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tokenizer=tokenizer,
        version=version,
        seed=seed,
    )


def _longest_prompt(config: RunConfig, episodes: TextEpisodes, data: Data) -> int:
    """Tokens the engine's context must hold before the generation budget: AHRL hints included, so a hinted
    rollout still gets rollout.max_new_tokens new tokens."""
    longest = max(len(episodes.prompt_ids(p)) for p in [*data.train, *data.eval])
    hints = config.algo.hints
    if hints is None:
        return longest
    return max(longest, longest_hinted_prompt(episodes, data.train, p_initial=hints.p_initial,
                                              think_open=hints.think_open))


def _check_supported(config: RunConfig) -> None:
    """Parts the config can name that this build cannot run yet: fail before any work, saying so."""
    if config.rollout.engine != "local":
        raise ValueError("rollout.engine=vllm is not available in this build yet; use rollout.engine=local")
    if config.backend.kind != "local":
        raise ValueError("backend.kind=ray is not available in this build yet; use backend.kind=local")
    if config.env.kind != "math":
        raise ValueError(f"env.kind={config.env.kind} (multi-turn agents) is not available in this build yet; "
                         "use env.kind=math")


def _sample_rows(batch: Sequence[Trajectory], episodes: TextEpisodes, count: int) -> list[dict[str, Any]]:
    rows = []
    for trajectory in list(batch)[:count]:
        versions = [v for v, m in zip(trajectory.policy_versions, trajectory.loss_mask) if m]
        rows.append({
            "prompt_id": trajectory.key.prompt_id,
            "sample": trajectory.key.sample,
            "prompt": episodes.decode(trajectory.tokens[: trajectory.prompt_length]),
            "completion": episodes.decode(trajectory.tokens[trajectory.prompt_length:]),
            "ground_truth": trajectory.prompt.ground_truth,
            "reward": trajectory.reward,
            "reason": trajectory.verdict.reason,
            "finish_reason": trajectory.finish_reason,
            "versions": [min(versions), max(versions)],
        })
    return rows


async def _run_async(config: RunConfig, run_dir: Path, resume: bool, reporter: Reporter) -> dict[str, Any]:
    started = time.perf_counter()
    # The newest checkpoint that opens fully (model files, states, ledger); damaged newer ones are kept aside.
    resumable = newest_intact_checkpoint(run_dir / "checkpoints", set_aside=True) if resume else None
    checkpoint = resumable.checkpoint if resumable is not None else None
    for aside, reason in resumable.skipped if resumable is not None else []:
        reporter.warn(f"skipped a damaged checkpoint ({reason}), kept as {aside}; resuming from {checkpoint}")
    data = load_data(config)
    if checkpoint is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(checkpoint / "model")
        model = load_model(checkpoint / "model", dtype=config.model.dtype)
    else:
        tokenizer, model = build_policy(config, data, run_dir, reporter)
    episodes = TextEpisodes(tokenizer)
    trainer_state = controller_state = meta = None
    if checkpoint is not None:
        trainer_state, controller_state, meta = resumable.trainer_state, resumable.controller_state, resumable.meta
        torch.set_rng_state(trainer_state["torch_rng"])
    version = trainer_state["version"] if trainer_state else 0
    engine = build_engine(
        model,
        tokenizer,
        max_batch_size=config.rollout.max_batch_size,
        max_new_tokens=config.rollout.max_new_tokens,
        longest_prompt=_longest_prompt(config, episodes, data),
        seed=config.seed,
        version=version,
    )
    order = PromptOrder(data.train, seed=config.data.shuffle_seed)
    schedule = config.scheduler
    scheduler = build_scheduler(
        schedule.kind,
        prompt_at=order.__getitem__,
        batch_groups=schedule.batch_groups,
        group_size=schedule.group_size,
        group_filter=_dynamic_sampling_filter if config.algo.dynamic_sampling else None,
        **{name: getattr(schedule, name) for name in scheduler_options(schedule.kind)},
    )
    pool = VerifierPool(
        [config.verifier.reward_fn],
        timeout_s=config.verifier.timeout_s,
        min_workers=config.verifier.min_workers,
        max_workers=config.verifier.max_workers,
        memory_limit_mb=config.verifier.memory_limit_mb,
    )
    overlap = not config.deterministic
    sampling = SamplingParams(
        max_new_tokens=config.rollout.max_new_tokens,
        temperature=config.rollout.temperature,
        top_k=config.rollout.top_k,
        top_p=config.rollout.top_p,
    )
    eval_params = SamplingParams(
        max_new_tokens=config.rollout.max_new_tokens,
        temperature=config.eval.temperature,
        top_p=config.eval.top_p,
    )
    eval_prompts = data.eval[: config.eval.num_prompts]

    async def held_out(version: int) -> EvalReport:
        return await evaluate(backend, episodes, eval_prompts, k=config.eval.k, params=eval_params, seed=config.seed)

    sink = MetricsSink(run_dir, tensorboard=config.log.tensorboard, wandb=config.log.wandb,
                       config=config.model_dump(mode="json"),
                       resume_step=version if resume else None)
    elapsed_before = meta["wall_seconds"] if meta else 0.0
    trainer = backend = None  # started inside the try, so the finally closes whatever did start
    try:
        trainer = start_trainer(config, model, tokenizer)
        backend = LocalBackend(engine, trainer, pool, tokenizer, overlap=overlap)
        if trainer_state is not None:
            trainer.load_state_dict(trainer_state)
        initial_path = run_dir / "initial_eval.json"
        if initial_path.exists():
            initial = json.loads(initial_path.read_text())
        else:
            with reporter.status("held-out evaluation before RL"):
                report = await held_out(0)
            initial = {"metrics": report.metrics(), "describe": report.describe()}
            _write_json_atomic(initial_path, initial)
            sink.log(0, report.metrics())
        reporter.note(f"before RL: {initial['describe']}")

        last_eval = dict(initial["metrics"])
        settings = LoopSettings(
            total_steps=config.trainer.steps,
            sampling=sampling,
            seed=config.seed,
            checkpoint_every=config.trainer.checkpoint_every,
            eval_every=config.eval.every,
            overlap=overlap,
            in_flight_updates=config.rollout.in_flight_updates,
        )
        progress = reporter.training(total=config.trainer.steps, completed=trainer.version)

        def on_step(version: int, metrics: dict[str, float], batch: Sequence[Trajectory]) -> None:
            if "eval/avg@k" in metrics:
                last_eval.update({k: v for k, v in metrics.items() if k.startswith("eval/")})
            sink.log(version, metrics)
            if config.log.samples_per_step:
                sink.samples(version, _sample_rows(batch, episodes, config.log.samples_per_step))
            progress.update(version, metrics, last_eval.get("eval/avg@k"))

        def on_checkpoint(version: int, state: dict[str, Any]) -> None:
            save_checkpoint(
                run_dir / "checkpoints",
                version,
                write_model=backend.save_model,
                trainer_state={**trainer.state_dict(), "torch_rng": torch.get_rng_state()},
                controller_state=state,
                meta={"wall_seconds": elapsed_before + time.perf_counter() - started},
                keep=config.trainer.keep_checkpoints,
            )

        async def evaluate_during(version: int) -> dict[str, float]:
            return (await held_out(version)).metrics()

        hints = None
        if config.algo.hints is not None:
            hints = HintedPrompts(
                episodes,
                await initial_pass_rates(config, run_dir, backend, episodes, data.train, sampling, reporter),
                p_initial=config.algo.hints.p_initial,
                gamma=config.algo.hints.gamma,
                pass_threshold=config.algo.hints.pass_threshold,
                pass_floor=config.algo.hints.pass_floor,
                think_open=config.algo.hints.think_open,
            )
            reporter.note(f"AHRL: {sum(hints.qualifies(p) for p in data.train)} of {len(data.train)} training "
                          "prompts qualify for hints")
        loop = RLLoop(backend, scheduler, episodes, settings, on_step=on_step, on_checkpoint=on_checkpoint,
                      evaluate=evaluate_during, hints=hints, version=trainer.version)
        if controller_state is not None:
            await loop.restore(controller_state)
            reporter.note(f"resumed from {checkpoint} at step {trainer.version} "
                          f"with {len(controller_state['inflight'])} in-flight partial rollouts")
        with progress:
            await loop.run()
        scheduler.ledger.check()

        final_metrics = last_eval
        if not (config.eval.every and config.trainer.steps % config.eval.every == 0) or not config.trainer.steps:
            with reporter.status("held-out evaluation after RL"):
                final_report = await held_out(trainer.version)
            final_metrics = final_report.metrics()
            sink.log(trainer.version, final_metrics)
            reporter.note(f"after RL: {final_report.describe()}")
        ledger = scheduler.ledger.summary()
        summary = {
            "run_dir": str(run_dir),
            "recipe": config.name,
            "initial_accuracy": initial["metrics"]["eval/avg@k"],
            "final_accuracy": final_metrics["eval/avg@k"],
            "eval_k": config.eval.k,
            "eval_prompts": len(eval_prompts),
            "wall_seconds": elapsed_before + time.perf_counter() - started,
            "optimizer_steps": trainer.version,
            "trained_trajectories": ledger["trained"],
            "dropped_trajectories": {k.split("/", 1)[1]: v for k, v in ledger.items() if k.startswith("dropped/")},
            "unfinished_at_end": ledger["outstanding"],
            "skipped_data_rows": data.skipped_rows,
            "verifier": pool.stats(),
        }
        _write_json_atomic(run_dir / "summary.json", summary)
        return summary
    finally:
        sink.close()
        if backend is not None:
            await backend.close()
        pool.close()
        if trainer is not None:
            trainer.close()


async def initial_pass_rates(config: RunConfig, run_dir: Path, backend: LocalBackend, episodes: TextEpisodes,
                             prompts: Sequence[Prompt], sampling: SamplingParams, reporter: Reporter) -> dict[str, float]:
    """AHRL's pass_x^initial: unbiased pass@k of the warm-start model on every training prompt with a reference
    think, from `hints.samples` samples each; measured once (before the first RL step) and kept in the run."""
    path = run_dir / "pass_initial.json"
    if path.exists():
        return json.loads(path.read_text())
    hints = config.algo.hints
    candidates = [p for p in prompts if p.reference_think is not None]
    if not candidates:
        raise ValueError("algo.hints is set but no training prompt has a reference think (extra_info.reference_think)")
    with reporter.status(f"AHRL: pass@{hints.k} of the warm start on {len(candidates)} training prompts"):
        report = await evaluate(backend, episodes, candidates, k=hints.samples, params=sampling, seed=config.seed + 1)
    rates = {pid: pass_at_k(hints.samples, correct, hints.k) for pid, correct in report.correct.items()}
    _write_json_atomic(path, rates)
    return rates


def _dynamic_sampling_filter(group: Sequence[Trajectory]) -> bool:
    rewards = torch.tensor([t.reward for t in group])
    return bool(dynamic_sampling_keep(rewards, torch.zeros(len(group), dtype=torch.long)).all())


def run_training(config: RunConfig, *, run_dir: Path | None = None, resume: bool = False,
                 reporter: Reporter | None = None) -> dict[str, Any]:
    """Run (or resume) the job; returns the summary also written to run_dir/summary.json."""
    _check_supported(config)
    reporter = reporter or Reporter(enabled=config.log.progress)
    if resume:
        assert run_dir is not None, "resume needs the run directory"
    else:
        run_dir = run_dir or default_run_dir(config)
        if (run_dir / "checkpoints").exists():
            raise ValueError(f"{run_dir} already holds a run; pass --resume {run_dir} to continue it, "
                             "or choose another --output")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(config))
    seed_everything(config.seed)
    torch.set_num_threads(config.backend.torch_threads)
    summary = asyncio.run(_run_async(config, run_dir, resume, reporter))
    plots = plot_run(run_dir)
    reporter.summary(summary, plots)
    return summary


def read_run_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ValueError(f"{run_dir} is not a run directory (no config.yaml); pass the --output of an earlier run")
    fix = "restore it from a backup, or rewrite it (`flashreinforce train RECIPE --dry-run` prints a resolved config)"
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} (the run's resolved config) is not valid YAML ({' '.join(str(error).split())}); "
                         f"{fix}") from None
    if not isinstance(tree, dict):
        raise ValueError(f"{path} (the run's resolved config) holds a {type(tree).__name__}, not a mapping of "
                         f"sections; {fix}")
    return tree


def sft_only(config: RunConfig, output: Path) -> Path:
    """`flashreinforce sft`: the warm start alone, saved to OUTPUT/sft, then its held-out accuracy."""
    from flashreinforce.cli.evaluate import evaluate_checkpoint

    if config.model.path is not None:
        raise ValueError("sft warm-starts a model built from scratch; unset model.path")
    if config.sft.steps == 0:
        raise ValueError("sft.steps is 0: nothing to do")
    output.mkdir(parents=True, exist_ok=True)
    (output / "config.yaml").write_text(dump_config(config))
    seed_everything(config.seed)
    torch.set_num_threads(config.backend.torch_threads)
    build_policy(config, load_data(config), output, Reporter(enabled=config.log.progress))
    evaluate_checkpoint(output / "sft", data=None, recipe=None, k=config.eval.k, num_prompts=None,
                        temperature=config.eval.temperature, top_p=config.eval.top_p, max_new_tokens=None,
                        seed=config.seed, json_path=output / "sft_eval.json")
    return output / "sft"
