"""The `vision` recipe over several seeds: does every seed gain on held-out pictures, and how fast?

Runs the shipped `vision` recipe (a small transformer with its own vision encoder, SFT warm start, then
FlashREINFORCE on the exact-match reward) once per seed, each seed drawing its own pictures, warm start and
rollouts. The table gives, per seed, held-out avg@k at T=1 before RL (after the warm start) and after, the greedy
accuracy after, each task's avg@k before and after, and the wall time of the whole run (warm start, RL and the
evaluations): what `flashreinforce train vision seed=N` takes on this machine.

    python benchmarks/vision.py                 # seeds 0 1 2 (~3-4 min each on 2 cores)
    python benchmarks/vision.py --seeds 3 4     # other seeds
    python benchmarks/vision.py --quick         # a smoke run with tiny settings (well under a minute)
    flashreinforce bench vision --json bench-out/vision.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from flashreinforce.config import load_config
from flashreinforce.metrics.sink import read_metrics
from flashreinforce.run import run_training

# `flashreinforce bench` runs this file with runpy, which does not put its directory on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import Machine

QUICK = [  # tiny settings: checks that every run goes through, not the figures
    *(f"tasks.{task}.data.vision.{field}" for task in ("count", "tallest", "most")
      for field in ("num_train=100", "num_eval=8")),
    "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2", "sft.steps=10", "sft.batch_size=8", "rollout.max_batch_size=16",
    "scheduler.batch_groups=8", "trainer.steps=3", "trainer.microbatch_size=8", "trainer.checkpoint_every=3",
    "eval.num_prompts=8", "eval.k=1", "eval.every=3",
]


@dataclass(frozen=True)
class SeedRun:
    seed: int
    before: float
    after: float
    greedy_after: float
    tasks: dict[str, tuple[float, float]]
    """task -> held-out avg@k (%) before and after RL."""
    wall_seconds: float
    dropped: int


def task_scores(run_dir: Path) -> dict[str, tuple[float, float]]:
    """Each visual task's held-out avg@k (its data_source, vision/<task>) at the first and the last evaluation."""
    evals = [row for row in read_metrics(run_dir / "metrics.jsonl") if "eval/avg@k" in row]
    first, last = evals[0], evals[-1]
    names = sorted(key.split("/")[2] for key in first if key.startswith("eval/vision/") and key.endswith("/avg@k"))
    return {name: (first[f"eval/vision/{name}/avg@k"], last[f"eval/vision/{name}/avg@k"]) for name in names}


def run_seed(seed: int, overrides: list[str], out: Path) -> SeedRun:
    config = load_config("vision", [*overrides, f"seed={seed}", "log.progress=false"])
    run_dir = out / f"seed{seed}"
    summary = run_training(config, run_dir=run_dir)
    return SeedRun(seed, summary["initial_accuracy"], summary["final_accuracy"], summary["final_greedy_accuracy"],
                   task_scores(run_dir), summary["wall_seconds"], sum(summary["dropped_trajectories"].values()))


def table(runs: list[SeedRun]) -> str:
    names = sorted({name for run in runs for name in run.tasks})
    lines = ["| seed | held-out before → after | gain | greedy after | "
             + " | ".join(f"{name} before → after" for name in names) + " | wall s | dropped |",
             "|---" * (6 + len(names)) + "|"]
    for run in runs:
        per_task = " | ".join(f"{run.tasks[n][0]:.1f}% → {run.tasks[n][1]:.1f}%" for n in names)
        lines.append(f"| {run.seed} | {run.before:.1f}% → {run.after:.1f}% | {run.after - run.before:+.1f} | "
                     f"{run.greedy_after:.1f}% | {per_task} | {run.wall_seconds:.0f} | {run.dropped} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("bench-out/vision"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the rows and the machine here")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, key=value")
    args = parser.parse_args(argv)
    machine = Machine.measure()
    print(machine.describe())
    overrides = [*(QUICK if args.quick else []), *args.overrides]
    runs = [run_seed(seed, overrides, args.out) for seed in args.seeds]
    print(table(runs))
    machine.warn_if_busy()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine.as_dict(), "runs": [asdict(r) for r in runs]}, indent=1))


if __name__ == "__main__":
    main()
