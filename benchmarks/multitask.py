"""The `multitask` recipe against each of its tasks trained alone: does training them together cost any task?

Runs the shipped `multitask` recipe (arithmetic reasoning, the tool_multiply agent, instruction following and a
picture task in one run), then each task alone: the same recipe with only that task in `tasks:`, starting from the
mixture's warm start (its SFT checkpoint, so "before" is the same model on the same held-out prompts), with the
same batch, learning rate and evaluation. What "the same budget" means is --budget:
- rows (default): an alone run trains as many prompts of its task as the mixture did, steps x the task's share
  of the weights (sums 120 steps; tool, follow and most 60 each; beside the mixture's 300): the same exposure,
  so the difference is what sharing the model with the other tasks did;
- steps: as many optimizer steps as the mixture, so an alone run sees 2-4x more of its task.

Every run prints its usual console line and writes its run directory under OUT; the table at the end gives each
task's held-out accuracy (its own held-out set, verifier and sampling, `eval.k` samples per prompt) before RL
(after the warm start) and after, in the mixture and alone, and each run's wall time.

    python benchmarks/multitask.py                         # the recipe and its four tasks alone (~20-25 min)
    python benchmarks/multitask.py --only mixture          # the recipe alone (~6-9 min on 2 cores)
    python benchmarks/multitask.py --quick                 # a smoke run with tiny settings (about a minute)
    flashreinforce bench multitask --json bench-out/multitask.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from flashreinforce.config import RunConfig, load_config
from flashreinforce.run import run_training

# `flashreinforce bench` runs this file with runpy, which does not put its directory on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import Machine

QUICK = [  # tiny settings: checks that every run goes through, not the figures
    "tasks.sums.data.arithmetic.num_train=200", "tasks.sums.data.arithmetic.num_eval=16",
    "tasks.tool.data.tool_multiply.num_train=100", "tasks.tool.data.tool_multiply.num_eval=16",
    "tasks.follow.data.instructions.num_train=200", "tasks.follow.data.instructions.num_eval=16",
    "tasks.most.data.vision.num_train=100", "tasks.most.data.vision.num_eval=16",
    "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
    "sft.steps=20", "sft.batch_size=16", "rollout.max_batch_size=24", "scheduler.batch_groups=12",
    "trainer.steps=4", "trainer.microbatch_size=12", "trainer.checkpoint_every=4",
    "eval.num_prompts=8", "eval.k=1", "eval.every=4",
]


@dataclass(frozen=True)
class Score:
    """One task's held-out accuracy (%) in one run."""

    run: str
    """"mixture" or "alone"."""
    task: str
    steps: int
    before: float
    after: float
    wall_seconds: float


def alone(config: RunConfig, name: str, budget: str, warm_start: Path) -> RunConfig:
    """The recipe with only task `name`, from the mixture's warm start, trained for the same rows of it or the
    same steps (--budget)."""
    weights = {n: task.weight for n, task in config.task_list()}
    steps = config.trainer.steps
    if budget == "rows":
        steps = max(1, round(steps * weights[name] / sum(weights.values())))
    raw = config.model_dump()
    raw["tasks"] = {name: raw["tasks"][name]}
    raw["trainer"]["steps"] = steps
    raw["model"]["path"], raw["sft"]["steps"] = str(warm_start), 0
    raw["name"] = f"{config.name}-{name}-alone"
    return RunConfig.model_validate(raw)


def scores(run: str, config: RunConfig, summary: dict) -> list[Score]:
    return [Score(run, name, summary["optimizer_steps"], summary["tasks"][name]["initial_accuracy"],
                  summary["tasks"][name]["final_accuracy"], summary["wall_seconds"])
            for name, _ in config.task_list()]


def table(rows: list[Score]) -> str:
    lines = ["| task | run | steps | held-out before | after | gain | wall s |", "|---|---|---|---|---|---|---|"]
    for row in sorted(rows, key=lambda r: (r.task, r.run != "mixture")):
        lines.append(f"| {row.task} | {row.run} | {row.steps} | {row.before:.1f}% | {row.after:.1f}% | "
                     f"{row.after - row.before:+.1f} | {row.wall_seconds:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/multitask"))
    parser.add_argument("--budget", choices=("rows", "steps"), default="rows")
    parser.add_argument("--only", choices=("all", "mixture", "alone"), default="all")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--warm-start", type=Path, help="the alone runs' starting model (default: the mixture "
                        "run's SFT checkpoint, OUT/multitask/sft)")
    parser.add_argument("--json", type=Path, help="also write the rows and the machine here")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, key=value")
    args = parser.parse_args(argv)
    machine = Machine.measure()
    print(machine.describe())
    config = load_config("multitask", [*(QUICK if args.quick else []), *args.overrides,
                                       "log.progress=false"])
    rows: list[Score] = []
    if args.only != "alone":
        rows += scores("mixture", config, run_training(config, run_dir=args.out / config.name))
    warm_start = args.warm_start or args.out / config.name / "sft"
    for name, _ in config.task_list() if args.only != "mixture" else ():
        run_config = alone(config, name, args.budget, warm_start)
        rows += scores("alone", run_config, run_training(run_config, run_dir=args.out / run_config.name))
    print(table(rows))
    machine.warn_if_busy()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine.as_dict(), "budget": args.budget,
                                         "rows": [asdict(r) for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
