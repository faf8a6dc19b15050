"""Train/inference mismatch: how far the engine's behavior log-probs sit from the trainer's, per precision and mode.

Rows: precision (fp32, bf16, fp8) x mode x model. Modes (models/numerics.py, config.precision):
- rollout-only: the trainer in fp32, the engine at the precision with its own bf16 kernels (precision.trainer=fp32,
  precision.rollout=P, mode=separate), the common "quantize the inference server only" setup;
- separate: both sides at the precision, each with its own bf16 kernels (trainer=rollout=P, mode=separate);
- unified: both sides hold the same quantized weights and compute in fp32 (trainer=rollout=P, mode=unified).
For fp32 the three modes are one configuration, so fp32 has one row per model. Models: the default recipe's
tiny dense model, and an MoE model of the same width (--experts routed experts, top --top-k, plus the shared
expert) trained with router replay off ("moe") and on ("moe+replay"); both MoE rows share one warm start and
sample the very same rollouts, so they differ only in the trainer's routing.

Each model family is warm-started once by SFT on the arithmetic traces (so its distributions are peaked like a
policy's, not the near-uniform ones of random weights) and kept in memory for every row (on disk too with
--cache). Then per row, exactly as a run does it: the trainer is built from the run config (run/learner.py:
fp32 masters, the model formatted to trainer precision), the engine (run/engines.py) loads trainer.weights()
as version 0 (a weight push), samples the same --prompts held-out prompts with the same seeds at T=1, and one
Trainer.step trains on them with FlashREINFORCE (reward: the math verifier). Reported, all on the weights
before that step (the step's first forward is on them):
- |delta log-prob| mean / max: mismatch/same_weights_abs_mean / _max, |behavior - recomputed| over every
  sampled token (all were sampled by the weights the trainer recomputes with, so this is numerics alone);
- routes differ: mismatch/route_disagreement, the (token, layer) expert sets that differ between the engine
  and the trainer's own router;
- gate accept: loss/acceptance_rate, rows with the FlashREINFORCE sequence KL D_i <= delta (3e-3), and at
  delta 1e-3 (the reference's setting for its 7B tool and ALFWorld runs), with the largest D_i of the batch;
- MISC accept: policy tokens whose rho = exp(log pi_old - log mu) lies in MiscOptions' default IcePop band,
  from a separate no-grad recompute of pi_old through the trainer's first forward (Trainer.first_forward: its
  microbatches, packed where the recipe packs); its own mean gap is in the JSON (recompute_abs_mean) as a check
  against the trainer's metric;
- engine tok/s: sampled tokens / seconds inside Engine.step; train s: time/train_seconds of the step.

    python benchmarks/mismatch.py --prompts 256        # the table in docs/numerics.md: ~3 min, most of it SFT
    python benchmarks/mismatch.py --quick              # smoke run (~10 s): tiny model, 16 prompts, 20 SFT steps
    flashreinforce bench mismatch --cache bench-out/mismatch-cache --json bench-out/mismatch.json
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from flashreinforce.algorithms.flashreinforce import sequence_bernoulli_kl
from flashreinforce.algorithms.objectives import MiscOptions
from flashreinforce.config import RunConfig, load_config
from flashreinforce.envs.single_turn import TextEpisodes, to_trajectory
from flashreinforce.metrics.console import Reporter
from flashreinforce.rollout.engine import Engine
from flashreinforce.run.data import Data, load_data
from flashreinforce.run.engines import (
    EngineShape,
    build_local_engine,
    longest_rendered,
    rollout_params,
)
from flashreinforce.run.learner import build_trainer
from flashreinforce.run.policy import Policy, build_policy, seed_everything
from flashreinforce.trainer.trainer import Trainer
from flashreinforce.types import Prompt, RolloutKey, Trajectory
from flashreinforce.verifiers.math import math_reward

# Run as a script, benchmarks/ is on sys.path already; imported by path (a test), it is not.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import Machine

PRECISIONS = ("fp32", "bf16", "fp8")
MODES = ("rollout-only", "separate", "unified")
MODELS = ("dense", "moe", "moe+replay")
FAMILY = {"dense": "dense", "moe": "moe", "moe+replay": "moe"}
"""Which warm start a model row uses: both MoE rows share one (they differ only in the trainer's routing)."""


@dataclass(frozen=True)
class Settings:
    """Sizes of a run; the model shape is the default recipe's tiny one unless --quick shrinks it."""

    prompts: int = 128
    sft_steps: int = 400
    """The default recipe's warm start (about 50% held-out for the dense model): peaked like a policy's."""
    hidden: int = 128
    layers: int = 2
    experts: int = 8
    top_k: int = 2
    max_new_tokens: int = 64
    num_train: int = 20000
    seed: int = 0


QUICK = Settings(prompts=16, sft_steps=20, hidden=64, experts=4, num_train=2000)
"""Checks that every row runs and the table's structure, not the figures."""


@dataclass(frozen=True)
class Row:
    precision: str
    mode: str
    """One of MODES; fp32 rows say "fp32" (its three modes are one configuration)."""
    model: str

    @property
    def name(self) -> str:
        return f"{self.precision} {self.mode} {self.model}"


@dataclass(frozen=True)
class Measurement:
    """One row's figures, all on the weights before its training step."""

    row: Row
    same_weights_abs_mean: float
    same_weights_abs_max: float
    route_disagreement: float | None
    gate_acceptance: float
    gate_acceptance_tight: float
    """Rows with D_i <= TIGHT_DELTA."""
    sequence_kl_max: float
    misc_acceptance: float
    recompute_abs_mean: float
    """The benchmark's own recompute of the mean gap: should match same_weights_abs_mean to float rounding."""
    engine_tokens_per_second: float
    train_seconds: float
    sampled_tokens: int
    reward_mean: float
    wall_seconds: float


@dataclass(frozen=True)
class WarmStart:
    family: str
    policy: Policy
    seconds: float
    cached: str | None
    """The directory it was saved to or reused from (--cache), else None."""


def all_rows() -> list[Row]:
    """fp32 once per model, then bf16 and fp8 in every mode; the order of the table and the plot."""
    rows = [Row("fp32", "fp32", model) for model in MODELS]
    rows += [Row(precision, mode, model) for precision in PRECISIONS[1:] for mode in MODES for model in MODELS]
    return rows


def family_overrides(settings: Settings, family: str) -> list[str]:
    """The default recipe with this benchmark's sizes; the MoE family swaps every MLP for routed experts."""
    overrides = [f"seed={settings.seed}", f"sft.steps={settings.sft_steps}",
                 f"model.tiny.hidden_size={settings.hidden}", f"model.tiny.num_layers={settings.layers}",
                 f"rollout.max_new_tokens={settings.max_new_tokens}", f"rollout.max_batch_size={settings.prompts}",
                 f"data.arithmetic.num_train={settings.num_train}", "algo.loss=flashreinforce"]
    if family == "moe":
        overrides += [f"model.tiny.num_experts={settings.experts}", f"model.tiny.experts_per_token={settings.top_k}"]
    return overrides


def row_overrides(row: Row) -> list[str]:
    """config.precision and trainer.router_replay for a row (the run reads the same fields)."""
    if row.precision == "fp32":
        trainer, rollout, mode = "fp32", "fp32", "separate"
    elif row.mode == "rollout-only":
        trainer, rollout, mode = "fp32", row.precision, "separate"
    else:
        trainer, rollout, mode = row.precision, row.precision, row.mode
    return [f"precision.trainer={trainer}", f"precision.rollout={rollout}", f"precision.mode={mode}",
            f"trainer.router_replay={row.model == 'moe+replay'}"]


def row_config(settings: Settings, row: Row) -> RunConfig:
    return load_config(None, [*family_overrides(settings, FAMILY[row.model]), *row_overrides(row)])


def warm_start(config: RunConfig, family: str, data: Data, cache: Path | None) -> WarmStart:
    """SFT from the seed (build_policy), saved under cache/<hash of its settings>/ and reused from there."""
    started = time.perf_counter()
    settings = {k: config.model_dump(mode="json")[k] for k in ("seed", "model", "data", "sft")}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    seed_everything(config.seed)
    if cache is None:
        with tempfile.TemporaryDirectory() as scratch:  # build_policy stages its result in a directory
            policy = build_policy(config, data, Path(scratch), Reporter(enabled=False))
        return WarmStart(family, policy, time.perf_counter() - started, None)
    directory = cache / f"{family}-{key}"
    directory.mkdir(parents=True, exist_ok=True)
    policy = build_policy(config, data, directory, Reporter(enabled=False))
    return WarmStart(family, policy, time.perf_counter() - started, str(directory / "sft"))


def sample(engine: Engine, episodes: TextEpisodes, prompts: Sequence[Prompt], config: RunConfig) -> list[Trajectory]:
    """One rollout per prompt, request i seeded with i (the same stream in every row), scored by the verifier."""
    params = rollout_params(config)
    for i, prompt in enumerate(prompts):
        engine.submit(str(i), episodes.prompt_ids(prompt), replace(params, seed=i))
    generations = {}
    while engine.has_work:
        generations.update((g.request_id, g) for g in engine.step())
    trajectories = []
    for i, prompt in enumerate(prompts):
        generation = generations[str(i)]
        verdict = math_reward(episodes.completion_text(generation), prompt.ground_truth)
        trajectories.append(to_trajectory(RolloutKey(prompt.id, 0), prompt, i, generation, verdict))
    return trajectories


TIGHT_DELTA = 1e-3


@dataclass(frozen=True)
class Recompute:
    misc_acceptance: float
    abs_mean: float
    sequence_kl: torch.Tensor  # (B,) D_i of every row


def recompute(trainer: Trainer, trajectories: Sequence[Trajectory]) -> Recompute:
    """pi_old of every sampled token through the trainer's model, as the step's first forward reads it.

    Trainer.step reports mean and max gaps but not per-token ratios, which MISC's token band needs;
    Trainer.first_forward repeats that forward (the step's microbatches, packed where the recipe packs, MoE routes
    replayed when the trainer replays them) without a gradient.
    """
    low, high = MiscOptions().icepop_band
    inside, gap, tokens, kl = 0, 0.0, 0, []
    for micro, logprobs in trainer.first_forward(trajectories):
        current = logprobs.masked_fill(~micro.loss_mask, 0.0)  # (b, T)
        kl.append(sequence_bernoulli_kl(micro.behavior_logprobs, current, micro.loss_mask.sum(-1)))
        log_rho = (logprobs - micro.behavior_logprobs)[micro.loss_mask]  # (policy tokens,)
        rho = log_rho.exp()
        inside += int(((rho >= low) & (rho <= high)).sum())
        gap += float(log_rho.abs().sum())
        tokens += log_rho.numel()
    return Recompute(misc_acceptance=inside / tokens, abs_mean=gap / tokens, sequence_kl=torch.cat(kl))


def measure(settings: Settings, row: Row, warm: WarmStart, prompts: Sequence[Prompt]) -> Measurement:
    """Build the row's trainer and engine from the warm start, push the weights, sample, recompute, step."""
    started = time.perf_counter()
    config = row_config(settings, row)
    policy = warm.policy
    trainer = build_trainer(config, copy.deepcopy(policy.model), policy.tokenizer)
    episodes = TextEpisodes(policy.tokenizer)
    shape = EngineShape(longest_rendered(episodes, prompts), config.rollout.max_new_tokens, 0, config.seed)
    engine = build_local_engine(config, policy, shape)  # its own copy of the model, in rollout precision
    engine.load_weights(trainer.weights(), 0)  # what a run pushes: the trainer's formatted weights
    trajectories = sample(engine, episodes, prompts, config)
    check = recompute(trainer, trajectories)
    metrics = trainer.step(trajectories)  # its metrics come from its first forward, on the pre-step weights
    stats = engine.stats
    return Measurement(
        row=row,
        same_weights_abs_mean=metrics["mismatch/same_weights_abs_mean"],
        same_weights_abs_max=metrics["mismatch/same_weights_abs_max"],
        route_disagreement=metrics.get("mismatch/route_disagreement"),
        gate_acceptance=metrics["loss/acceptance_rate"],
        gate_acceptance_tight=float((check.sequence_kl <= TIGHT_DELTA).float().mean()),
        sequence_kl_max=float(check.sequence_kl.max()),
        misc_acceptance=check.misc_acceptance,
        recompute_abs_mean=check.abs_mean,
        engine_tokens_per_second=stats.sampled_tokens / stats.step_seconds,
        train_seconds=metrics["time/train_seconds"],
        sampled_tokens=stats.sampled_tokens,
        reward_mean=metrics["reward/mean"],
        wall_seconds=time.perf_counter() - started,
    )


def find(measurements: Sequence[Measurement], precision: str, mode: str, model: str) -> Measurement:
    return next(m for m in measurements if m.row == Row(precision, mode, model))


def verdict(smaller: float, larger: float) -> str:
    """Whether `smaller < larger` as claimed; a tie is its own verdict (replay changes nothing where no route
    flipped, and a gate that admits every row admits every row either way)."""
    return "holds" if smaller < larger else "ties" if smaller == larger else "FAILS"


def claims(measurements: Sequence[Measurement]) -> list[str]:
    """The expectations the table is read against, each stated with its verdict (nothing is tuned to them)."""
    lines = []
    for precision in PRECISIONS[1:]:
        for model in MODELS:
            unified = find(measurements, precision, "unified", model).same_weights_abs_mean
            separate = find(measurements, precision, "separate", model).same_weights_abs_mean
            lines.append(f"{precision} {model}: unified mean gap {unified:.2e} < separate {separate:.2e}: "
                         f"{verdict(unified, separate)}")
    plain = find(measurements, "bf16", "rollout-only", "moe")
    replay = find(measurements, "bf16", "rollout-only", "moe+replay")
    for label, field in (("mean gap", "same_weights_abs_mean"), ("max gap", "same_weights_abs_max")):
        a, b = getattr(replay, field), getattr(plain, field)
        lines.append(f"fp32 trainer / bf16 rollout MoE: replay {label} {a:.3g} < no replay {b:.3g}: {verdict(a, b)}")
    for label, field in (("gate acceptance (delta 3e-3)", "gate_acceptance"),
                         (f"gate acceptance (delta {TIGHT_DELTA:g})", "gate_acceptance_tight")):
        a, b = getattr(replay, field), getattr(plain, field)
        lines.append(f"fp32 trainer / bf16 rollout MoE: replay {label} {a:.1%} > no replay {b:.1%}: {verdict(b, a)}")
    dense = max(find(measurements, "fp32", "fp32", model).same_weights_abs_max for model in MODELS)
    lines.append(f"fp32 on both sides: largest max gap of the three models {dense:.2e}")
    return lines


def table(measurements: Sequence[Measurement]) -> str:
    header = ("| precision | mode | model | mean abs dlogp | max abs dlogp | routes differ | gate accept | "
              f"gate accept {TIGHT_DELTA:g} | max D_i | MISC accept | engine tok/s | train s |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in measurements:
        routes = "-" if m.route_disagreement is None else f"{m.route_disagreement:.2%}"
        lines.append(f"| {m.row.precision} | {m.row.mode} | {m.row.model} | {m.same_weights_abs_mean:.2e} | "
                     f"{m.same_weights_abs_max:.2e} | {routes} | {m.gate_acceptance:.1%} | "
                     f"{m.gate_acceptance_tight:.1%} | {m.sequence_kl_max:.1e} | {m.misc_acceptance:.2%} | "
                     f"{m.engine_tokens_per_second:,.0f} | {m.train_seconds:.2f} |")
    return "\n".join(lines)


def plot(measurements: Sequence[Measurement], path: Path) -> None:
    """Mean gap and the batch's largest D_i (log scales) per row, grouped by precision, colored by model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"dense": "#1f77b4", "moe": "#d62728", "moe+replay": "#2ca02c"}
    xs, x, previous = [], 0.0, None
    for m in measurements:  # a gap between precision groups, a smaller one between modes
        if previous is not None:
            x += 1.0 + (1.0 if m.row.precision != previous.precision else 0.4 if m.row.mode != previous.mode else 0)
        xs.append(x)
        previous = m.row
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    bar_colors = [colors[m.row.model] for m in measurements]
    # A zero gap (bitwise agreement) has no place on a log axis: drawn at the floor instead.
    top.bar(xs, [max(m.same_weights_abs_mean, 1e-9) for m in measurements], color=bar_colors)
    top.set_yscale("log")
    top.set_ylabel("mean |behavior - recomputed| log-prob")
    top.set_title("train/inference mismatch on the same weights (one batch, T=1)")
    # Acceptance is ~100% almost everywhere at these gaps; the largest D_i shows how close each row is to the gate.
    bottom.bar(xs, [max(m.sequence_kl_max, 1e-10) for m in measurements], color=bar_colors)
    bottom.set_yscale("log")
    for delta, style in ((3e-3, "--"), (TIGHT_DELTA, ":")):
        bottom.axhline(delta, color="black", linestyle=style, linewidth=0.8, label=f"delta {delta:g}")
    bottom.legend(fontsize=8, loc="upper left")
    bottom.set_ylabel("largest sequence KL D_i")
    bottom.set_xticks(xs, [f"{m.row.precision}\n{m.row.mode}" if m.row.model == "moe" else "" for m in measurements],
                      fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    top.legend(handles, list(colors), fontsize=8, loc="upper left")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Settings()
    parser.add_argument("--prompts", type=int, default=defaults.prompts, help="held-out prompts sampled per row")
    parser.add_argument("--sft-steps", type=int, default=defaults.sft_steps)
    parser.add_argument("--experts", type=int, default=defaults.experts, help="routed experts of the MoE model")
    parser.add_argument("--top-k", type=int, default=defaults.top_k, help="experts per token of the MoE model")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--cache", type=Path, help="save the warm starts here and reuse them on later runs")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--png", type=Path, default=Path("bench-out/mismatch.png"), help="where to save the plot")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny model, few prompts and SFT steps")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    if args.quick:
        return replace(QUICK, seed=args.seed)
    return Settings(prompts=args.prompts, sft_steps=args.sft_steps, experts=args.experts, top_k=args.top_k,
                    seed=args.seed)


def run(settings: Settings, cache: Path | None) -> tuple[list[Measurement], dict[str, WarmStart]]:
    """Every row in order; the warm starts once per family, before the first row that needs them."""
    rows = all_rows()
    base = load_config(None, family_overrides(settings, "dense"))
    data = load_data(base)  # the data does not depend on the model family
    prompts = data.eval[: settings.prompts]
    if len(prompts) < settings.prompts:
        raise SystemExit(f"--prompts {settings.prompts}: the held-out split has only {len(data.eval)} prompts")
    warm: dict[str, WarmStart] = {}
    measurements = []
    for row in rows:
        family = FAMILY[row.model]
        if family not in warm:
            warm[family] = warm_start(row_config(settings, row), family, data, cache)
            print(f"warm start {family}: {warm[family].seconds:.0f} s"
                  + (f" ({warm[family].cached})" if warm[family].cached else ""), flush=True)
        measurements.append(measure(settings, row, warm[family], prompts))
        m = measurements[-1]
        print(f"  {row.name}: mean gap {m.same_weights_abs_mean:.2e}, {m.wall_seconds:.1f} s", flush=True)
    return measurements, warm


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    machine = Machine.measure()
    print(machine.describe())
    machine.warn_if_busy()
    settings = settings_from(args)
    started = time.perf_counter()
    measurements, warm = run(settings, args.cache)
    wall = time.perf_counter() - started
    print(f"\n{settings.prompts} held-out arithmetic prompts per row, T=1, one FlashREINFORCE step (delta 3e-3); "
          f"MISC band {MiscOptions().icepop_band}; hidden {settings.hidden}, {settings.layers} layers, MoE "
          f"{settings.experts} experts top-{settings.top_k}, {settings.sft_steps} SFT steps\n")
    print(table(measurements))
    verdicts = claims(measurements)
    print("\n" + "\n".join(verdicts))
    print(machine.describe())
    machine.warn_if_busy()
    plot(measurements, args.png)
    print(f"plot: {args.png}; wall {wall:.0f} s")
    if args.json:
        report = {
            "machine": machine.as_dict(),
            "argv": sys.argv[1:] if argv is None else list(argv),
            "settings": asdict(settings),
            "warm_starts": {f: {"seconds": w.seconds, "cached": w.cached} for f, w in warm.items()},
            "rows": [{**asdict(m), "row": asdict(m.row), "name": m.row.name} for m in measurements],
            "claims": verdicts,
            "png": str(args.png),
            "wall_seconds": wall,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
