"""The `ernie_mopd` recipe: one student distilled from an RL expert per task, against each expert and one RL run.

Runs the shipped `ernie_mopd` pipeline (the ernie warm start; one short RL expert per task, each from the warm start;
a `distill` stage from the warm start, each task scored by its own expert) with one more stage appended: `mixture`,
RL on all five tasks from the same warm start for as many steps as the experts and the distillation took together
(the one-mixture run of the same total steps). One pipeline, so every stage starts from the same warm start and is
scored on the same held-out prompts with the same verifiers and sampling.

The table gives, per task, its held-out avg@k after the warm start, after its expert, after the distillation (the
student), after the mixture run, and the student's gaps to its expert and to the mixture; then each stage's steps and
wall time. The teacher's own score as the distill stage measured it (it must equal the expert's) is in the JSON.

    python benchmarks/mopd.py                  # the recipe and the mixture stage (on 2 cores about 30 min)
    python benchmarks/mopd.py --quick          # tiny settings, end to end (a few minutes): checks, not figures
    flashreinforce bench mopd --json bench-out/mopd.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from flashreinforce.config import RunConfig, config_from_tree, load_config
from flashreinforce.run import run_training

# `flashreinforce bench` runs this file with runpy, which does not put its directory on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import Machine

QUICK = [  # tiny settings: every stage goes through, the figures mean nothing
    "tasks.sums.data.arithmetic.num_train=200", "tasks.sums.data.arithmetic.num_eval=8",
    "tasks.tool.data.tool_multiply.num_train=100", "tasks.tool.data.tool_multiply.num_eval=8",
    "tasks.follow.data.instructions.num_train=200", "tasks.follow.data.instructions.num_eval=8",
    "tasks.most.data.vision.num_train=100", "tasks.most.data.vision.num_eval=8",
    "tasks.game.data.text_game.num_train=100", "tasks.game.data.text_game.num_eval=8",
    "tasks.game.env.max_turns=3", "tasks.game.rollout.max_new_tokens=120",
    "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
    "sft.batch_size=16", "rollout.max_batch_size=16", "rollout.max_new_tokens=48", "scheduler.batch_groups=8",
    "trainer.microbatch_size=8", "eval.num_prompts=4", "eval.k=1", "verifier.max_workers=1",
    "stages.0.steps=20", *(f"stages.{index}.steps=2" for index in range(1, 6)), "stages.6.steps=3",
    "deterministic=true",  # lockstep: the same batches every time
]


@dataclass(frozen=True)
class TaskRow:
    """One task's held-out avg@k (%) at each point of the pipeline."""

    task: str
    warm: float
    expert: float
    student: float
    mixture: float
    teacher: float
    """The expert's score as the distill stage measured it (teacher_eval.json): the same model and prompts."""
    expert_stage: str


@dataclass(frozen=True)
class StageRow:
    stage: str
    kind: str
    steps: int
    wall_seconds: float | None
    """An RL or distill stage's own (its summary's, evaluations included); None for an sft stage."""


def with_mixture(config: RunConfig) -> RunConfig:
    """The pipeline with a last RL stage on every task, from the distill stage's start, for the steps of every
    stage that trains by RL (the experts and the distillation)."""
    distill = next(stage for stage in config.stages if stage.kind == "distill")
    steps = sum(stage.steps for stage in config.stages if stage.kind != "sft")
    tree = config.model_dump(mode="json", by_alias=True)
    tree["stages"].append({"name": "mixture", "from": distill.start, "steps": steps})
    return config_from_tree(tree)


def task_rows(config: RunConfig, summary: dict) -> list[TaskRow]:
    stages = {stage["stage"]: stage for stage in summary["stages"]}
    index = next(i for i, stage in enumerate(config.stages) if stage.kind == "distill")
    distill, warm = config.stages[index], config.stages[index].start
    teachers = config.stage(index).teachers
    student, mixture = stages[distill.name], stages["mixture"]
    rows = []
    for task in student["tasks"]:
        expert = teachers[task if task in teachers else "all"].stage
        rows.append(TaskRow(task, stages[warm]["tasks"][task]["final_accuracy"],
                            stages[expert]["tasks"][task]["final_accuracy"], student["tasks"][task]["final_accuracy"],
                            mixture["tasks"][task]["final_accuracy"], student["tasks"][task]["teacher_accuracy"],
                            expert))
    return rows


def stage_rows(summary: dict) -> list[StageRow]:
    return [StageRow(stage["stage"], stage["kind"], stage["steps"], stage.get("wall_seconds"))
            for stage in summary["stages"]]


def table(tasks: list[TaskRow], stages: list[StageRow], wall_seconds: float) -> str:
    lines = ["| task | warm start | its expert | student (distilled) | mixture RL | student - expert | "
             "student - mixture |", "|---|---|---|---|---|---|---|"]
    for row in tasks:
        lines.append(f"| {row.task} | {row.warm:.1f}% | {row.expert:.1f}% ({row.expert_stage}) | {row.student:.1f}% "
                     f"| {row.mixture:.1f}% | {row.student - row.expert:+.1f} | {row.student - row.mixture:+.1f} |")
    within = sum(row.student >= row.expert - 3 for row in tasks)
    above = sum(row.student > row.mixture for row in tasks)
    lines += ["", f"student within 3 points of its expert on {within} of {len(tasks)} tasks; above the mixture run "
              f"on {above} of {len(tasks)}", "", "| stage | kind | steps | wall s |", "|---|---|---|---|"]
    lines += [f"| {row.stage} | {row.kind} | {row.steps} | "
              f"{'-' if row.wall_seconds is None else f'{row.wall_seconds:.0f}'} |" for row in stages]
    lines.append(f"| the whole pipeline, evaluations included | | | {wall_seconds:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/mopd"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the rows and the machine here")
    parser.add_argument("overrides", nargs="*", help="config overrides of the recipe, key=value")
    args = parser.parse_args(argv)
    machine = Machine.measure()
    print(machine.describe())
    config = with_mixture(load_config("ernie_mopd", [*(QUICK if args.quick else []), *args.overrides,
                                                     "log.progress=false"]))
    started = time.perf_counter()
    summary = run_training(config, run_dir=args.out / config.name)
    wall_seconds = time.perf_counter() - started
    tasks, stages = task_rows(config, summary), stage_rows(summary)
    print(table(tasks, stages, wall_seconds))
    machine.warn_if_busy()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine.as_dict(), "quick": args.quick,
                                         "wall_seconds": wall_seconds, "run_dir": summary["run_dir"],
                                         "tasks": [asdict(row) for row in tasks],
                                         "stages": [asdict(row) for row in stages]}, indent=1))


if __name__ == "__main__":
    main()
