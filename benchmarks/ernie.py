"""ERNIE 5.0's RL claims, measured in miniature on the `multitask` recipe's four tasks (arithmetic reasoning, the
tool_multiply agent, instruction following, a picture question read by the tiny model's own encoder).

Every run starts from one warm start (the recipe's SFT, built once and cached under OUT/warm) and is the recipe
with the overrides its claim names, so two runs of a claim differ in one thing. Four claims:
- schedulers: `sync`, `april` and `urb` on the mixture, whose tasks take very different times (a 3-turn tool
  episode runs Python between its turns; a picture answer is a few tokens): steps/s, and which tasks the trained
  batches hold over time against the data order (APRIL trains what finishes first; U-RB trains the data order).
  Columns: each task's share of the trained rows over the first 5 steps and over all steps (the data order's
  shares are the weights': sums 40%, the others 20%), their total-variation distance from it, and the share of
  rollouts trained at another step than their data-order step;
- icepop: GSPO with sequence-level IcePop (`algo.loss=gspo`, `mismatch: seq_icepop`) against MISC (GSPO-token
  with a token IcePop mask, a narrower band for image tokens) on the text+image batch, the rollout in bf16 so
  behavior and trainer log-probs differ (`precision.rollout=fp8` on the command line for a larger mismatch):
  policy entropy per modality over the steps, the masked token fraction per modality, held-out per modality
  (image: `most`; text: the mean of the three text tasks);
- wpsm: MISC with well-learned positive sample masking against the same MISC run without it: entropy and
  held-out of the easy task (`most`, ~67% after the warm start) and the hard one (`tool`, ~10%);
- ahrl: arithmetic alone, AHRL hints on the training prompts the warm start rarely solves, on against off; the
  hard set is the held-out arithmetic prompts the warm start solved in none of 4 samples; every checkpoint of
  both runs is scored on it with 4 fresh samples (so is the warm start: selecting on 0 of 4 and re-measuring with
  the same samples would read 0 by construction).

Prints one table per claim and writes OUT/ernie.png (one panel per claim); --json keeps every number.

    python benchmarks/ernie.py                     # every claim (~35 min on 2 cores)
    python benchmarks/ernie.py --claims wpsm,ahrl  # some of them
    python benchmarks/ernie.py --quick             # a smoke run with tiny settings (a few minutes)
    flashreinforce bench ernie --json bench-out/ernie.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashreinforce.config import RunConfig, load_config
from flashreinforce.run import run_training
from flashreinforce.run.data import Data, load_data
from flashreinforce.run.evaluation import score_prompts
from flashreinforce.run.sft import sft_only

# `flashreinforce bench` runs this file with runpy, which does not put its directory on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import Machine
from multitask import QUICK as MULTITASK_QUICK

CLAIMS = ("schedulers", "icepop", "wpsm", "ahrl")
QUICK = [*MULTITASK_QUICK, "scheduler.group_size=2", "scheduler.batch_groups=6", "trainer.microbatch_size=12"]
HELD_OUT_EVAL = ["eval.every=100000", "eval.k=2"]  # each run scores its tasks at its start and end
MISC = ["algo.loss=misc", "algo.options={modality_bands: {image: [0.9, 1.1, 3.0e-4, 4.0e-4]}}"]
GROUPED = ["scheduler.group_size=4", "scheduler.batch_groups=32", "precision.rollout=bf16"]
WPSM = ["algo.wpsm={tau: 0.5, eta: 0.3}"]
HARD_SAMPLES = 4


@dataclass
class Run:
    """One finished run: its summary and its per-step training rows."""

    name: str
    config: RunConfig
    summary: dict[str, Any]
    rows: list[dict[str, Any]]
    curve: list[tuple[int, float]] = field(default_factory=list)
    """ahrl: (step, % correct on the hard set) at the warm start and each checkpoint."""

    def series(self, key: str) -> list[float]:
        return [row.get(key, float("nan")) for row in self.rows]

    def mean(self, key: str, steps: slice = slice(None)) -> float:
        values = [v for v in self.series(key)[steps] if v == v]
        return statistics.fmean(values) if values else float("nan")

    def held_out(self, task: str) -> tuple[float, float]:
        scores = self.summary["tasks"][task]
        return scores["initial_accuracy"], scores["final_accuracy"]


@dataclass(frozen=True)
class Bench:
    """Where the runs go and the overrides around each claim's own."""

    out: Path
    first: list[str]
    """Before a claim's overrides (--quick's sizes)."""
    last: list[str]
    """After them: the command line's overrides win (e.g. precision.rollout=fp8 for the icepop claim)."""

    @property
    def warm(self) -> Path:
        return self.out / "warm" / "sft"


def warm_start(bench: Bench) -> None:
    """The multitask recipe's SFT model, built once under OUT/warm."""
    if not (bench.warm / "config.json").is_file():
        sft_only(load_config("multitask", [*bench.first, *bench.last]), bench.out / "warm")


def run(bench: Bench, name: str, overrides: Sequence[str], only: str | None = None) -> Run:
    """The multitask recipe from the warm start under `overrides`, with only task `only` if given (its run
    directory OUT/<name>)."""
    config = load_config("multitask", [*bench.first, *HELD_OUT_EVAL, *overrides, *bench.last,
                                       f"model.path={bench.warm}", "sft.steps=0", f"name=ernie-{name}"])
    if only is not None:
        raw = config.model_dump()
        raw["tasks"] = {only: raw["tasks"][only]}
        config = RunConfig.model_validate(raw)
    run_dir = bench.out / name
    summary = run_training(config, run_dir=run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return Run(name, config, summary, [row for row in rows if "loss/policy" in row])


def task_shares(run_: Run, steps: slice) -> dict[str, float]:
    """Each task's share of the trained rows over `steps`."""
    names = [name for name, _ in run_.config.task_list()]
    counts = {name: sum(row.get(f"task/{name}/rows", 0.0) for row in run_.rows[steps]) for name in names}
    total = sum(counts.values()) or 1.0
    return {name: count / total for name, count in counts.items()}


def data_shares(config: RunConfig) -> dict[str, float]:
    weights = {name: task.weight for name, task in config.task_list()}
    return {name: weight / sum(weights.values()) for name, weight in weights.items()}


def displaced_fraction(run_dir: Path, batch_groups: int) -> float:
    """Share of trained rollouts trained at another step than their data-order step: the step whose batch their
    prompt's scheduling position falls in (position // batch_groups), as `sync` and `urb` train them."""
    from flashreinforce.buffer import Ledger
    from flashreinforce.trainer.checkpoint import latest_checkpoint, load_states

    _, controller, _ = load_states(latest_checkpoint(run_dir / "checkpoints"))
    ledger = Ledger()
    ledger.load_state_dict(controller["scheduler"]["ledger"])
    position: dict[str, int] = {}
    for prompt_id, _sample, _status in controller["scheduler"]["ledger"]["entries"]:  # in scheduling order
        position.setdefault(prompt_id, len(position))
    trained = ledger.trained()
    off = sum(step != position[key.prompt_id] // batch_groups for key, step in trained.items())
    return off / max(len(trained), 1)


def schedulers_claim(bench: Bench, steps: int) -> tuple[list[Run], str]:
    runs = [run(bench, f"scheduler-{kind}", [f"scheduler.kind={kind}", f"trainer.steps={steps}",
                                             f"trainer.checkpoint_every={steps}"])
            for kind in ("sync", "april", "urb")]
    names = [name for name, _ in runs[0].config.task_list()]
    expected = data_shares(runs[0].config)
    lines = ["| scheduler | steps/s | " + " | ".join(f"{n} first 5 / all" for n in names)
             + " | TV from data first 5 / all | trained off their data step |",
             "|---|---|" + "---|" * len(names) + "---|---|",
             "| data order | | " + " | ".join(f"{100 * expected[n]:.0f}%" for n in names) + " | 0 | 0% |"]
    for r in runs:
        early, whole = task_shares(r, slice(0, 5)), task_shares(r, slice(None))
        tv = [0.5 * sum(abs(shares[n] - expected[n]) for n in names) for shares in (early, whole)]
        timed = r.series("time/step_seconds")[1:]  # the first step also builds the engine's caches
        lines.append(f"| `{r.config.scheduler.kind}` | {len(timed) / sum(timed):.2f} | "
                     + " | ".join(f"{100 * early[n]:.0f}% / {100 * whole[n]:.0f}%" for n in names)
                     + f" | {tv[0]:.3f} / {tv[1]:.3f} | "
                     f"{100 * displaced_fraction(bench.out / r.name, r.config.scheduler.batch_groups):.1f}% |")
    return runs, "\n".join(lines)


def modality_held_out(r: Run) -> dict[str, tuple[float, float]]:
    """Held-out before/after per modality: image is the picture task, text the mean of the others."""
    by_modality: dict[str, list[tuple[float, float]]] = {}
    for name, task in r.config.task_list():
        by_modality.setdefault("image" if task.data.kind == "vision" else "text", []).append(r.held_out(name))
    return {m: (statistics.fmean(b for b, _ in s), statistics.fmean(a for _, a in s)) for m, s in by_modality.items()}


def icepop_claim(bench: Bench, steps: int) -> tuple[list[Run], str]:
    common = [*GROUPED, f"trainer.steps={steps}", f"trainer.checkpoint_every={steps}"]
    runs = [run(bench, "gspo-seq-icepop", [*common, "algo.loss=gspo", "algo.options={mismatch: seq_icepop}"]),
            misc_run(bench, steps)]
    lines = ["| loss | modality | entropy first 5 steps | last 5 | masked token fraction (mean / max) | held-out before "
             "| after |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        held = modality_held_out(r)
        for m in ("text", "image"):
            masked = [v for v in r.series(f"modality/{m}/masked_fraction") if v == v]
            lines.append(f"| {r.name} | {m} | {r.mean(f'modality/{m}/entropy_mean', slice(0, 5)):.3f} | "
                         f"{r.mean(f'modality/{m}/entropy_mean', slice(-5, None)):.3f} | "
                         f"{100 * statistics.fmean(masked):.2f}% / {100 * max(masked):.1f}% | "
                         f"{held[m][0]:.1f}% | {held[m][1]:.1f}% |")
    return runs, "\n".join(lines)


def misc_run(bench: Bench, steps: int, *extra: str) -> Run:
    name = "misc-wpsm" if extra else "misc"
    return run(bench, name, [*GROUPED, *MISC, f"trainer.steps={steps}", f"trainer.checkpoint_every={steps}", *extra])


def wpsm_claim(bench: Bench, steps: int, without: Run) -> tuple[list[Run], str]:
    """MISC + WPSM against `without`: the icepop claim's MISC run (the same config without WPSM) when it ran."""
    runs = [without, misc_run(bench, steps, *WPSM)]
    lines = ["| run | task | entropy first 5 steps | last 5 | WPSM-flagged rows | held-out before | after |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        for task in ("most", "tool"):
            flagged = r.mean(f"task/{task}/wpsm/flagged_fraction")
            before, after = r.held_out(task)
            lines.append(f"| {r.name} | {task} | {r.mean(f'task/{task}/entropy_mean', slice(0, 5)):.3f} | "
                         f"{r.mean(f'task/{task}/entropy_mean', slice(-5, None)):.3f} | "
                         f"{'-' if flagged != flagged else f'{100 * flagged:.1f}%'} | {before:.1f}% | {after:.1f}% |")
    return runs, "\n".join(lines)


def hard_set(config: RunConfig, warm: Path, seed: int) -> Data:
    """The held-out prompts the warm start solves in none of HARD_SAMPLES samples."""
    held_out = load_data(config)
    report = score_prompts(config, warm, held_out, k=HARD_SAMPLES, seed=seed)
    hard = [p for p in held_out.eval if report.correct[p.id] == 0]
    return Data([], hard, 0, {name: ([], [p for p in hard if p.task == name]) for name in held_out.by_task})


def hard_accuracy(config: RunConfig, model: Path, hard: Data, seed: int) -> float:
    report = score_prompts(config, model, hard, k=HARD_SAMPLES, seed=seed)
    return 100 * sum(report.correct.values()) / (HARD_SAMPLES * max(len(hard.eval), 1))


def ahrl_claim(bench: Bench, steps: int, quick: bool) -> tuple[list[Run], str]:
    every = max(1, steps // 4)
    # AHRL first measures the warm start's pass@4 on every training prompt: 2,000 of them, not 20,000
    sums = [f"tasks.sums.data.arithmetic.num_train={100 if quick else 2000}", f"trainer.steps={steps}",
            f"trainer.checkpoint_every={every}", "trainer.keep_checkpoints=100"]  # every one is scored
    hints = ["algo.hints={p_initial: 0.5, gamma: 0.05, k: 4, samples: 4, pass_threshold: 0.25, pass_floor: 0.1}"]
    runs = [run(bench, "ahrl-off", sums, only="sums"),
            run(bench, "ahrl-on", [*sums, *hints], only="sums")]
    config = runs[0].config
    hard = hard_set(config, bench.warm, seed=101)
    start = hard_accuracy(config, bench.warm, hard, seed=202)
    for r in runs:
        checkpoints = sorted((bench.out / r.name / "checkpoints").glob("step_*"))
        r.curve = [(0, start)] + [(int(c.name.split("_")[1]), hard_accuracy(config, c / "model", hard, seed=202))
                                  for c in checkpoints]
    steps_seen = [s for s, _ in runs[0].curve]
    lines = ["| run | hinted training prompts | " + " | ".join(f"hard set at step {s}" for s in steps_seen)
             + " | whole held-out before | after |", "|---|---|" + "---|" * len(steps_seen) + "---|---|"]
    for r in runs:
        hinted = r.mean("hints/hinted_fraction")
        lines.append(f"| {r.name} | {'-' if hinted != hinted else f'{100 * hinted:.0f}% of rows'} | "
                     + " | ".join(f"{accuracy:.1f}%" for _, accuracy in r.curve)
                     + f" | {r.held_out('sums')[0]:.1f}% | {r.held_out('sums')[1]:.1f}% |")
    lines.append(f"\nhard set: {len(hard.eval)} of {len(load_data(config).eval)} held-out prompts")
    return runs, "\n".join(lines)


def plot(results: dict[str, list[Run]], path: Path) -> None:
    """One panel per claim that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(2, len(results))
    rows = -(-len(results) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.8 * rows), squeeze=False)
    for axis in axes.flat[len(results):]:
        axis.set_visible(False)
    for axis, (claim, runs) in zip(axes.flat, results.items()):
        if claim == "schedulers":
            for r in runs:
                axis.plot([row["step"] for row in r.rows], r.series("task/tool/rows"), label=r.config.scheduler.kind)
            axis.set(title="tool-agent rows per trained batch (sync and urb: the data order's)", xlabel="step")
        elif claim == "ahrl":
            for r in runs:
                axis.plot(*zip(*r.curve), marker="o", label=r.name)
            axis.set(title="held-out hard set (% correct)", xlabel="step")
        else:
            groups = ("text", "image") if claim == "icepop" else ("most", "tool")
            prefix = "modality" if claim == "icepop" else "task"
            for r in runs:
                for group, style in zip(groups, ("-", "--")):
                    axis.plot([row["step"] for row in r.rows], r.series(f"{prefix}/{group}/entropy_mean"), style,
                              label=f"{r.name} {group}")
            axis.set(title=f"policy entropy per {prefix} ({claim})", xlabel="step")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/ernie"))
    parser.add_argument("--claims", default=",".join(CLAIMS), help=f"comma-separated, of {', '.join(CLAIMS)}")
    parser.add_argument("--steps", type=int, default=60, help="RL steps of every run (the scheduler runs: 40)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the tables' numbers and the machine here")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, key=value")
    args = parser.parse_args(argv)
    claims = [c for c in args.claims.split(",") if c]
    if unknown := set(claims) - set(CLAIMS):
        parser.error(f"unknown claim(s) {', '.join(sorted(unknown))}: choose from {', '.join(CLAIMS)}")
    machine = Machine.measure()
    print(machine.describe())
    bench = Bench(args.out, [*(QUICK if args.quick else []), "log.progress=false", "log.tensorboard=false"],
                  list(args.overrides))
    steps = 4 if args.quick else args.steps
    warm_start(bench)
    results: dict[str, list[Run]] = {}
    tables: dict[str, str] = {}
    if "schedulers" in claims:
        results["schedulers"], tables["schedulers"] = schedulers_claim(bench, 4 if args.quick else 40)
    if "icepop" in claims:
        results["icepop"], tables["icepop"] = icepop_claim(bench, steps)
    if "wpsm" in claims:
        without = results["icepop"][1] if "icepop" in results else misc_run(bench, steps)
        results["wpsm"], tables["wpsm"] = wpsm_claim(bench, steps, without)
    if "ahrl" in claims:
        results["ahrl"], tables["ahrl"] = ahrl_claim(bench, steps, args.quick)
    for claim, text in tables.items():
        print(f"\n## {claim}\n\n{text}")
    plot(results, args.out / "ernie.png")
    print(f"\nplot: {args.out / 'ernie.png'}")
    machine.warn_if_busy()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine.as_dict(), "tables": tables,
                                         "runs": {c: [{"name": r.name, "summary": r.summary, "curve": r.curve}
                                                      for r in runs] for c, runs in results.items()}},
                                        indent=1, default=str))


if __name__ == "__main__":
    main()
