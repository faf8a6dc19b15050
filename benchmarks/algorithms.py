"""FlashREINFORCE against GRPO on a real model: one rollout a prompt against groups, at equal and at half rollouts.

FlashREINFORCE's claim is that one rollout per prompt with a batch-mean baseline matches or beats group methods
while spending half the rollouts. This runs the shipped `smollm2` recipe (SmolLM2-135M-Instruct on reasoning-gym
arithmetic, bf16, lockstep) from the same start in four arms, over several seeds:

    fr          FlashREINFORCE, 32 prompts x 1 rollout a step (the recipe as shipped)
    grpo        GRPO, 8 prompts x 4 rollouts a step (the same 32 rollouts a step; same lr)
    fr_half     FlashREINFORCE, 16 prompts x 1 rollout a step (half the rollouts)
    fr_filter   FlashREINFORCE with the entropy filter on failed rows (negative_token_fraction, default 0.2)

Every arm takes the recipe's 48 optimizer steps and is scored on the same 256 held-out questions (avg@1 at T=0.7,
and greedy) before RL, halfway (step 24) and at the end, so each arm is read against rollouts consumed (fr and
grpo at step 24 have used as many rollouts as fr_half at its end) and against training wall time (the sum of its
steps' times; evaluation excluded). The table gives the median and the range over seeds; the PNG draws the curves.

    python benchmarks/algorithms.py                       # arms x seeds 0 1 2 (~9 min a run on 2 cores, ~1.7 h)
    python benchmarks/algorithms.py --arms fr grpo --seeds 3 4
    python benchmarks/algorithms.py --keep                # reuse runs already finished under --out
    python benchmarks/algorithms.py --quick               # harness check: 2 steps on a few prompts (~2 min)
    flashreinforce bench algorithms --json bench-out/algorithms.json

The model comes from `flashreinforce models get smollm2-135m-instruct`; the data from the reasoning-gym extra.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from flashreinforce.config import load_config
from flashreinforce.metrics.sink import read_metrics
from flashreinforce.run import run_training

# `flashreinforce bench` runs this file with runpy, which does not put its directory on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import Machine

RECIPE = "smollm2"


@dataclass(frozen=True)
class Arm:
    label: str
    overrides: tuple[str, ...]


def arms(filter_fraction: float) -> dict[str, Arm]:
    return {
        "fr": Arm("FlashREINFORCE 32x1", ()),
        # GRPO's options are its own (eps 0.2 clip); the recipe's delta belongs to FlashREINFORCE.
        "grpo": Arm("GRPO 8x4", ("algo.loss=grpo", "algo.options={}", "scheduler.batch_groups=8",
                                 "scheduler.group_size=4")),
        "fr_half": Arm("FlashREINFORCE 16x1", ("scheduler.batch_groups=16",)),
        "fr_filter": Arm(f"FlashREINFORCE 32x1, q={filter_fraction:g}",
                         (f"algo.options.negative_token_fraction={filter_fraction}",)),
    }


FULL = ("eval.every=24",)
QUICK = (  # a few prompts and tokens: checks that every arm runs and is read back, not the figures
    "trainer.steps=2", "eval.every=1", "eval.num_prompts=4", "rollout.max_new_tokens=8",
    "data.reasoning_gym.num_train=64", "data.reasoning_gym.num_eval=8", "trainer.checkpoint_every=0",
)
QUICK_BATCH = {"fr": 4, "grpo": 1, "fr_half": 2, "fr_filter": 4}
"""--quick's prompts a step per arm, in the full run's proportions (4 rollouts a step; fr_half 2)."""


@dataclass(frozen=True)
class Point:
    step: int
    rollouts: int
    """Trajectories trained on up to this evaluation."""
    train_seconds: float
    """The summed wall time of the optimizer steps up to this evaluation (evaluations excluded)."""
    avg: float
    greedy: float


DIAGNOSTICS = {  # training metrics averaged over a run's steps: what each arm's updates looked like
    "response/length_mean": "response tokens",
    "response/truncated_fraction": "truncated",
    "entropy/mean": "entropy",
    "advantage/abs_mean": "mean abs advantage",
    "optim/grad_norm": "grad norm",
    "loss/acceptance_rate": "gate admitted",
}


@dataclass(frozen=True)
class ArmRun:
    arm: str
    seed: int
    points: list[Point]
    wall_seconds: float
    dropped: int
    diagnostics: dict[str, float]
    """DIAGNOSTICS' metrics, each the mean over the run's training steps (absent where the loss has none)."""

    @property
    def gain(self) -> float:
        return self.points[-1].avg - self.points[0].avg


def curve(run_dir: Path) -> list[Point]:
    """Held-out scores at each evaluation, with the rollouts and the training time spent to reach it."""
    points, rollouts, seconds = [], 0, 0.0
    for row in read_metrics(run_dir / "metrics.jsonl"):  # one row a step: its training and its evaluation merged
        rollouts += int(row.get("batch/rows", 0))
        seconds += row.get("time/step_seconds", 0.0)
        if "eval/avg@k" in row:
            points.append(Point(row["step"], rollouts, seconds, row["eval/avg@k"], row["eval/greedy_accuracy"]))
    return points


def diagnostics(run_dir: Path) -> dict[str, float]:
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "loss/policy" in row]
    return {key: statistics.fmean(row[key] for row in rows) for key in DIAGNOSTICS
            if rows and all(key in row for row in rows)}


def run_arm(name: str, arm: Arm, seed: int, overrides: list[str], out: Path, keep: bool) -> ArmRun:
    run_dir = out / f"{name}-seed{seed}"
    if not (keep and (run_dir / "summary.json").exists()):
        config = load_config(RECIPE, [*arm.overrides, *overrides, f"seed={seed}", "log.progress=false"])
        run_training(config, run_dir=run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    return ArmRun(name, seed, curve(run_dir), summary["wall_seconds"], sum(summary["dropped_trajectories"].values()),
                  diagnostics(run_dir))


def spread(values: list[float], digits: int = 1) -> str:
    """Median [min, max]; one value alone."""
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:.{digits}f}"
    return f"{median:.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def at_rollouts(run: ArmRun, rollouts: int) -> Point | None:
    return next((point for point in run.points if point.rollouts == rollouts), None)


def table(runs: list[ArmRun], labels: dict[str, str]) -> str:
    """One row per arm: held-out at the start, at the arm's end, and at the rollouts the cheapest arm ends on."""
    names = [name for name in labels if any(run.arm == name for run in runs)]
    equal = min(run.points[-1].rollouts for run in runs)
    lines = [f"| arm | seeds | before | after | gain | greedy before → after | at {equal} rollouts | rollouts "
             "| train s | run s |", "|---" * 10 + "|"]
    for name in names:
        mine = [run for run in runs if run.arm == name]
        first, last = [run.points[0] for run in mine], [run.points[-1] for run in mine]
        equal_points = [point.avg for run in mine if (point := at_rollouts(run, equal)) is not None]
        lines.append(
            f"| {labels[name]} | {','.join(str(run.seed) for run in mine)} | {spread([p.avg for p in first])} | "
            f"{spread([p.avg for p in last])} | {spread([run.gain for run in mine])} | "
            f"{spread([p.greedy for p in first])} → {spread([p.greedy for p in last])} | "
            f"{spread(equal_points) if equal_points else '-'} | {spread([p.rollouts for p in last], 0)} | "
            f"{spread([p.train_seconds for p in last], 0)} | {spread([run.wall_seconds for run in mine], 0)} |")
    return "\n".join(lines)


def seeds_table(runs: list[ArmRun], labels: dict[str, str]) -> str:
    """Every run's curve: where an arm wins or loses, by seed and by phase."""
    lines = ["| arm | seed | avg@1 at each evaluation (step: score) | greedy | dropped |", "|---" * 5 + "|"]
    for run in sorted(runs, key=lambda run: (list(labels).index(run.arm), run.seed)):
        avg = ", ".join(f"{p.step}: {p.avg:.1f}" for p in run.points)
        greedy = ", ".join(f"{p.greedy:.1f}" for p in run.points)
        lines.append(f"| {labels[run.arm]} | {run.seed} | {avg} | {greedy} | {run.dropped} |")
    return "\n".join(lines)


def diagnostics_table(runs: list[ArmRun], labels: dict[str, str]) -> str:
    """Per arm, the median over seeds of each run's mean training metric: why an arm learns faster or slower."""
    lines = ["| arm | " + " | ".join(DIAGNOSTICS.values()) + " |", "|---" * (1 + len(DIAGNOSTICS)) + "|"]
    for name, label in labels.items():
        mine = [run for run in runs if run.arm == name]
        if not mine:
            continue
        cells = [f"{statistics.median(run.diagnostics[key] for run in mine):.3g}"
                 if all(key in run.diagnostics for run in mine) else "-" for key in DIAGNOSTICS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[ArmRun], labels: dict[str, str], path: Path) -> None:
    """Held-out avg@1 and greedy against rollouts consumed, avg@1 against training time: median line, range band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("rollouts", "avg", "rollouts consumed", "held-out avg@1 (%)"),
              ("train_seconds", "avg", "training wall time (s)", "held-out avg@1 (%)"),
              ("rollouts", "greedy", "rollouts consumed", "held-out greedy (%)"))
    figure, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8))
    for axis, (x_field, y_field, x_label, y_label) in zip(axes, panels):
        for name, label in labels.items():
            mine = [run for run in runs if run.arm == name]
            if not mine:
                continue
            count = min(len(run.points) for run in mine)
            x = [statistics.median(getattr(run.points[i], x_field) for run in mine) for i in range(count)]
            ys = [[getattr(run.points[i], y_field) for run in mine] for i in range(count)]
            line, = axis.plot(x, [statistics.median(y) for y in ys], marker="o", label=label)
            axis.fill_between(x, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.15)
        axis.set_xlabel(x_label)
        axis.set_ylabel(y_label)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(f"SmolLM2-135M-Instruct, {RECIPE} recipe: median over seeds, band = range")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=["fr", "grpo", "fr_half", "fr_filter"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--filter-fraction", type=float, default=0.2,
                        help="fr_filter's negative_token_fraction: the share of a failed row's tokens kept")
    parser.add_argument("--out", type=Path, default=Path("bench-out/algorithms"))
    parser.add_argument("--keep", action="store_true", help="reuse a run whose summary.json is already under --out")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, help="also write every run's curve and the machine here")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, key=value")
    args = parser.parse_args(argv)
    every = arms(args.filter_fraction)
    unknown = sorted(set(args.arms) - set(every))
    if unknown:
        parser.error(f"unknown arm(s) {unknown}: choose from {sorted(every)}")
    labels = {name: every[name].label for name in every if name in args.arms}
    machine = Machine.measure()
    print(machine.describe())
    runs = []
    for seed in args.seeds:  # seed by seed: an interrupted benchmark leaves whole seeds to compare
        for name in labels:
            sizes = [f"scheduler.batch_groups={QUICK_BATCH[name]}", *QUICK] if args.quick else list(FULL)
            runs.append(run_arm(name, every[name], seed, [*sizes, *args.overrides], args.out, args.keep))
            print(f"{name} seed {seed}: " + ", ".join(f"step {p.step} {p.avg:.1f}%" for p in runs[-1].points),
                  flush=True)
    print(table(runs, labels))
    print()
    print(seeds_table(runs, labels))
    print()
    print(diagnostics_table(runs, labels))
    plot(runs, labels, args.out / "algorithms.png")
    print(f"\nplot: {args.out / 'algorithms.png'}")
    machine.warn_if_busy()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine.as_dict(), "labels": labels,
                                         "runs": [asdict(run) for run in runs]}, indent=1))


if __name__ == "__main__":
    main()
