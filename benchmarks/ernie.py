"""ERNIE 5.0's RL claims, measured in miniature on the `multitask` recipe's tasks (arithmetic reasoning, the
tool_multiply agent, instruction following, a picture question read by the tiny model's own encoder), each over
several seeds (median and range).

Every run starts from one warm start (the recipe's SFT, built once and cached under OUT/warm) with every part the
recipe trains trainable (the vision encoder included), and is the recipe with the overrides its claim names, so
the arms of a claim differ in one thing. Four claims:
- schedulers: `sync`, `april` and `urb` on the mixture, whose tasks take very different times (a 3-turn tool
  episode runs Python between its turns; a picture answer is a few tokens): steps/s, each task's share of the
  trained rows over the first 5 steps and over all steps against the data order's (the weights'), their
  total-variation distance from it, and the share of rollouts trained at another step than their data step;
- wpsm: MISC with groups of 4 on an easy task (`most`, the picture question) and a hard one (`tool`), without
  WPSM, with WPSM as eq. 4 defines it (the default: every confident response of a well-learned query, right or
  wrong) and with the positive-only group-rate variant: entropy and held-out per task;
- ahrl: arithmetic prompts the warm start solves in none of 16 samples, trained with and without AHRL hints under
  GRPO with groups of 4 (where an all-fail group gives no gradient) and under FlashREINFORCE, the hints' schedule
  reaching no hint by the last step and each prompt's pass@4 estimated from 16 samples; held-out on the held-out
  prompts the warm start solves in none of 16 samples, scored without hints over the steps;
- icepop: GSPO with sequence-level IcePop against MISC, the rollout in fp8 so that behavior and trainer log-probs
  differ, each batch trained as 2 mini-batches so that the clip ranges act; the sequence band is set from the
  geometric-mean ratios the MISC runs logged (their median 1st and 99th percentiles). Entropy and masked fraction
  per modality over the steps, held-out per modality (image: `most`; text: the three text tasks' mean).

Prints one table per claim, writes OUT/ernie.png (one panel per claim) and, with --json, every number.

    python benchmarks/ernie.py                          # every claim, 3 seeds (about 1.5 h on 2 cores)
    python benchmarks/ernie.py --claims wpsm,ahrl --keep # some claims, reusing finished runs in OUT
    python benchmarks/ernie.py --quick                  # a smoke run with tiny settings (a few minutes)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
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

CLAIMS = ("schedulers", "wpsm", "ahrl", "icepop")
QUICK = [*MULTITASK_QUICK, "scheduler.batch_groups=6", "trainer.microbatch_size=12"]
COMMON = ["eval.every=100000", "eval.k=2", "trainer.freeze_vision=false"]  # scored at start and end; encoder trains
MISC = ["algo.loss=misc", "algo.options={modality_bands: {image: [0.9, 1.1, 3.0e-4, 4.0e-4]}}"]
GROUPED = ["scheduler.group_size=4", "scheduler.batch_groups=32"]
HARD_SAMPLES = 16
"""AHRL: a prompt is hard when the warm start solves it in none of this many samples."""


@dataclass
class Run:
    """One finished run: its summary and its per-step training rows."""

    name: str
    config: RunConfig
    summary: dict[str, Any]
    rows: list[dict[str, Any]]
    evals: list[dict[str, Any]] = field(default_factory=list)
    """The held-out evaluations' rows, in step order."""

    def series(self, key: str) -> list[float]:
        return [row.get(key, float("nan")) for row in self.rows]

    def mean(self, key: str, steps: slice = slice(None)) -> float:
        values = [v for v in self.series(key)[steps] if not math.isnan(v)]
        return statistics.fmean(values) if values else float("nan")

    def held_out(self, task: str) -> tuple[float, float]:
        scores = self.summary["tasks"][task]
        return scores["initial_accuracy"], scores["final_accuracy"]


@dataclass(frozen=True)
class Bench:
    """Where the runs go, the overrides around each claim's own, the seeds, and whether finished runs are kept."""

    out: Path
    first: list[str]
    """Before a claim's overrides (--quick's sizes)."""
    last: list[str]
    """After them: the command line's overrides win."""
    seeds: tuple[int, ...]
    keep: bool
    steps: int

    @property
    def warm(self) -> Path:
        return self.out / "warm" / "sft"


def warm_start(bench: Bench) -> None:
    """The multitask recipe's SFT model, built once under OUT/warm."""
    if not (bench.warm / "config.json").is_file():
        sft_only(load_config("multitask", [*bench.first, *bench.last]), bench.out / "warm")


def run(bench: Bench, name: str, overrides: Sequence[str], seed: int, only: Sequence[str] | None = None,
        before: Callable[[Path], None] | None = None) -> Run:
    """The multitask recipe from the warm start under `overrides` and `seed`, with only the tasks `only` if given,
    in OUT/<name>-s<seed>; with --keep a finished run there is read back instead. `before(run_dir)` prepares the
    directory of a run about to start."""
    config = load_config("multitask", [*bench.first, *COMMON, f"trainer.steps={bench.steps}",
                                       f"trainer.checkpoint_every={bench.steps}", *overrides, *bench.last,
                                       f"model.path={bench.warm}", "sft.steps=0", f"seed={seed}",
                                       f"name=ernie-{name}"])
    if only is not None:
        raw = config.model_dump()
        raw["tasks"] = {task: raw["tasks"][task] for task in only}
        config = RunConfig.model_validate(raw)
    run_dir = bench.out / f"{name}-s{seed}"
    if bench.keep and (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
    else:
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        if before is not None:
            before(run_dir)
        summary = run_training(config, run_dir=run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return Run(name, config, summary, [row for row in rows if "loss/policy" in row],
               [row for row in rows if "eval/avg@k" in row])


def seeded(bench: Bench, name: str, overrides: Sequence[str], **options: Any) -> list[Run]:
    return [run(bench, name, overrides, seed, **options) for seed in bench.seeds]


def spread(values: Sequence[float], digits: int = 1, scale: float = 1.0, unit: str = "") -> str:
    """median [min, max] of the seeds' values, the unit after the median: "96.7% [95.9, 97.1]" ("-": none)."""
    values = [scale * v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    text = f"{statistics.median(values):.{digits}f}{unit}"
    return text if len(values) == 1 else f"{text} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


# ---- schedulers ----------------------------------------------------------------------------------------------

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


def schedulers_claim(bench: Bench) -> tuple[list[Run], str]:
    arms = {kind: seeded(bench, f"scheduler-{kind}", [f"scheduler.kind={kind}"]) for kind in ("sync", "april", "urb")}
    names = [name for name, _ in arms["sync"][0].config.task_list()]
    expected = data_shares(arms["sync"][0].config)
    lines = ["| scheduler | steps/s | " + " | ".join(f"{n} first 5 / all" for n in names)
             + " | TV from data first 5 / all | trained off their data step |",
             "|---|---|" + "---|" * len(names) + "---|---|",
             "| data order | | " + " | ".join(f"{100 * expected[n]:.0f}%" for n in names) + " | 0 | 0% |"]
    for kind, runs in arms.items():
        shares = [(task_shares(r, slice(0, 5)), task_shares(r, slice(None))) for r in runs]
        tv = [[0.5 * sum(abs(s[n] - expected[n]) for n in names) for s in pair] for pair in shares]
        speed = [len(t) / sum(t) for t in (r.series("time/step_seconds")[1:] for r in runs)]  # step 1 builds caches
        off = [displaced_fraction(bench.out / f"{r.name}-s{seed}", r.config.scheduler.batch_groups)
               for r, seed in zip(runs, bench.seeds)]
        cells = [f"{spread([s[0][n] for s in shares], 0, 100, '%')} / {spread([s[1][n] for s in shares], 0, 100, '%')}"
                 for n in names]
        lines.append(f"| `{kind}` | {spread(speed, 2)} | " + " | ".join(cells)
                     + f" | {spread([t[0] for t in tv], 3)} / {spread([t[1] for t in tv], 3)} | "
                     f"{spread(off, 1, 100, '%')} |")
    return [r for runs in arms.values() for r in runs], "\n".join(lines)


# ---- WPSM ----------------------------------------------------------------------------------------------------

WPSM_ARMS = {
    "misc": [],
    "misc-wpsm-eq4": ["algo.wpsm={tau: 0.5, eta: 0.3}"],
    "misc-wpsm-positive": ["algo.wpsm={tau: 0.5, eta: 0.3, rate: group, positive_only: true}"],
}


def wpsm_claim(bench: Bench) -> tuple[list[Run], str]:
    lines = ["| run | task | entropy, first 5 steps | last 5 | WPSM-flagged rows | held-out before | after |",
             "|---|---|---|---|---|---|---|"]
    runs = []
    for arm, extra in WPSM_ARMS.items():
        seeds = seeded(bench, arm, [*GROUPED, *MISC, *extra], only=("most", "tool"))
        runs += seeds
        for task in ("most", "tool"):
            flagged = [r.mean(f"task/{task}/wpsm/flagged_fraction") for r in seeds]
            lines.append(f"| {arm} | {task} | {spread([r.mean(f'task/{task}/entropy_mean', slice(0, 5)) for r in seeds], 3)}"
                         f" | {spread([r.mean(f'task/{task}/entropy_mean', slice(-5, None)) for r in seeds], 3)} | "
                         f"{spread(flagged, 1, 100, '%')} | {spread([r.held_out(task)[0] for r in seeds], unit='%')} | "
                         f"{spread([r.held_out(task)[1] for r in seeds], unit='%')} |")
    return runs, "\n".join(lines)


# ---- AHRL ----------------------------------------------------------------------------------------------------

def hard_prompts(config: RunConfig, warm: Path, prompts: list, seed: int) -> list:
    """Those of `prompts` the warm start solves in none of HARD_SAMPLES samples (at the training temperature)."""
    data = Data([], prompts, 0, {name: ([], prompts if name == "sums" else []) for name in config.tasks})
    report = score_prompts(config, warm, data, k=HARD_SAMPLES, temperature=config.rollout.temperature, seed=seed)
    return [p for p in prompts if report.correct[p.id] == 0]


def write_rows(path: Path, prompts: list) -> None:
    """Prompts as data rows in the common format, their reference thinks kept (AHRL's hints)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in prompts:
            f.write(json.dumps({"id": p.id.split("/", 1)[1], "prompt": p.prompt, "data_source": p.data_source,
                                "reward_model": {"ground_truth": p.ground_truth},
                                "extra_info": {"reference_think": p.reference_think}}) + "\n")


def hard_sets(bench: Bench, num_train: int) -> tuple[Path, Path, int, int]:
    """OUT/ahrl/{train,eval}.jsonl: the arithmetic training and held-out prompts the warm start never solves."""
    directory = bench.out / "ahrl"
    if not (directory / "eval.jsonl").is_file():
        config = load_config("multitask", [*bench.first, *bench.last, f"tasks.sums.data.arithmetic.num_train={num_train}"])
        train, held_out = load_data(config).by_task["sums"]
        write_rows(directory / "train.jsonl", hard_prompts(config, bench.warm, train, seed=101))
        write_rows(directory / "eval.jsonl", hard_prompts(config, bench.warm, held_out, seed=102))
    count = [sum(1 for _ in (directory / f).open()) for f in ("train.jsonl", "eval.jsonl")]
    return directory / "train.jsonl", directory / "eval.jsonl", *count


def ahrl_claim(bench: Bench, quick: bool) -> tuple[list[Run], str]:
    train, held_out, num_train, num_eval = hard_sets(bench, 200 if quick else 3000)
    every = max(1, bench.steps // 4)
    # Hard by selection: pass@4 is 0 for every prompt (16 samples, none right); with pass_floor 0.25 the hint
    # 0.5 exp(-gamma t 0.25) x |think| (at most ~40 tokens) falls below one token by the last step.
    gamma = 16 / bench.steps
    hints = [f"algo.hints={{p_initial: 0.5, gamma: {gamma:g}, k: 4, samples: {HARD_SAMPLES}, "
             "pass_threshold: 0.25, pass_floor: 0.25}"]
    task = [f"tasks.sums.data={{kind: files, train: {train}, eval: {held_out}}}", f"eval.every={every}",
            f"eval.k={2 if quick else 8}", f"eval.num_prompts={num_eval}"]
    losses = {"grpo": ["algo.loss=grpo", "algo.options={}", *GROUPED], "flashreinforce": ["algo.loss=flashreinforce"]}
    pass_initial = {f"sums/{json.loads(line)['id']}": 0.0 for line in train.open()}

    def seed_pass_rates(run_dir: Path) -> None:  # measured once for every run: the same warm start, 16 samples
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "pass_initial.json").write_text(json.dumps(pass_initial))

    lines, runs = [], []
    for loss, settings in losses.items():
        for arm, extra in (("off", []), ("on", hints)):
            seeds = seeded(bench, f"ahrl-{loss}-{arm}", [*task, *settings, *extra], only=("sums",),
                           before=seed_pass_rates if extra else None)
            runs += seeds
            steps = [row["step"] for row in seeds[0].evals]
            if not lines:
                lines = ["| loss | hints | hinted rows | " + " | ".join(f"step {s}" for s in steps) + " |",
                         "|---|---|---|" + "---|" * len(steps)]
            curves = [[row["eval/avg@k"] for row in r.evals] for r in seeds]
            hinted = [r.mean("hints/hinted_fraction") for r in seeds]
            lines.append(f"| {loss} | {arm} | {spread(hinted, 0, 100, '%') if extra else '-'} | "
                         + " | ".join(spread([c[i] for c in curves], unit="%") for i in range(len(steps))) + " |")
    lines.append(f"\n{num_train} hard training prompts (of {200 if quick else 3000}), {num_eval} hard held-out prompts")
    return runs, "\n".join(lines)


# ---- IcePop on GSPO against MISC -------------------------------------------------------------------------------

def modality_held_out(r: Run) -> dict[str, tuple[float, float]]:
    """Held-out before/after per modality: image is the picture task, text the mean of the others."""
    by_modality: dict[str, list[tuple[float, float]]] = {}
    for name, task in r.config.task_list():
        by_modality.setdefault("image" if task.data.kind == "vision" else "text", []).append(r.held_out(name))
    return {m: (statistics.fmean(b for b, _ in s), statistics.fmean(a for _, a in s)) for m, s in by_modality.items()}


def icepop_claim(bench: Bench) -> tuple[list[Run], str]:
    common = [*GROUPED, "precision.rollout=fp8", "trainer.minibatches=2"]
    misc = seeded(bench, "icepop-misc", [*common, *MISC])
    low = statistics.median(r.mean("mismatch/seq_ratio_p01") for r in misc)
    high = statistics.median(r.mean("mismatch/seq_ratio_p99") for r in misc)
    band = f"[{low:.6f}, {high:.6f}]"
    gspo = seeded(bench, "icepop-gspo-seq", [*common, "algo.loss=gspo",
                                             f"algo.options={{mismatch: seq_icepop, seq_icepop_band: {band}}}"])
    lines = ["| loss | modality | entropy, first 5 steps | last 5 | masked tokens a step (mean) | clipped | "
             "held-out before | after |", "|---|---|---|---|---|---|---|---|"]
    for name, runs in (("GSPO + seq_icepop", gspo), ("MISC", misc)):
        held = [modality_held_out(r) for r in runs]
        for m in ("text", "image"):
            lines.append(f"| {name} | {m} | {spread([r.mean(f'modality/{m}/entropy_mean', slice(0, 5)) for r in runs], 3)}"
                         f" | {spread([r.mean(f'modality/{m}/entropy_mean', slice(-5, None)) for r in runs], 3)} | "
                         f"{spread([r.mean(f'modality/{m}/masked_fraction') for r in runs], 2, 100, '%')} | "
                         f"{spread([r.mean('loss/clip_fraction') for r in runs], 1, 100, '%')} | "
                         f"{spread([h[m][0] for h in held], unit='%')} | {spread([h[m][1] for h in held], unit='%')} |")
    lines.append(f"\nsequence band {band}: the MISC runs' median 1st and 99th percentile of the rows' geometric-mean "
                 "ratio (per step, averaged over the steps)")
    return misc + gspo, "\n".join(lines)


# ---- the report --------------------------------------------------------------------------------------------------

def plot(results: dict[str, list[Run]], path: Path) -> None:
    """One panel per claim that ran (each run a line, seeds of an arm in one colour)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(2, len(results))
    rows = -(-len(results) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.8 * rows), squeeze=False)
    for axis in axes.flat[len(results):]:
        axis.set_visible(False)
    for axis, (claim, runs) in zip(axes.flat, results.items()):
        colours: dict[str, str] = {}
        for r in runs:
            colour = colours.setdefault(r.name, f"C{len(colours)}")
            label = r.name if sum(x.name == r.name for x in runs[:runs.index(r) + 1]) == 1 else None
            if claim == "schedulers":
                axis.plot([row["step"] for row in r.rows], r.series("task/tool/rows"), color=colour, label=label)
            elif claim == "ahrl":
                axis.plot([row["step"] for row in r.evals], [row["eval/avg@k"] for row in r.evals], marker="o",
                          color=colour, label=label)
            else:
                key = "modality/image/entropy_mean" if claim == "icepop" else "task/most/entropy_mean"
                axis.plot([row["step"] for row in r.rows], r.series(key), color=colour, label=label)
        titles = {"schedulers": "tool-agent rows per trained batch", "ahrl": "hard held-out set (avg@k, no hints)",
                  "icepop": "image-token entropy", "wpsm": "entropy of the easy task (most)"}
        axis.set(title=titles[claim], xlabel="step")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/ernie"))
    parser.add_argument("--claims", default=",".join(CLAIMS), help=f"comma-separated, of {', '.join(CLAIMS)}")
    parser.add_argument("--steps", type=int, default=40, help="RL steps of every run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--keep", action="store_true", help="read back runs that finished in OUT instead of rerunning")
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
                  list(args.overrides), tuple(args.seeds[:1] if args.quick else args.seeds), args.keep,
                  4 if args.quick else args.steps)
    warm_start(bench)
    results: dict[str, list[Run]] = {}
    tables: dict[str, str] = {}
    claim_functions = {"schedulers": schedulers_claim, "wpsm": wpsm_claim, "icepop": icepop_claim,
                       "ahrl": lambda b: ahrl_claim(b, args.quick)}
    for claim in claims:
        results[claim], tables[claim] = claim_functions[claim](bench)
        print(f"\n## {claim}\n\n{tables[claim]}", flush=True)
    plot(results, args.out / "ernie.png")
    print(f"\nplot: {args.out / 'ernie.png'}")
    machine.warn_if_busy()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine.as_dict(), "seeds": list(bench.seeds), "tables": tables,
                                         "runs": {c: [{"name": r.name, "seed": r.config.seed, "summary": r.summary,
                                                       "evals": r.evals} for r in runs]
                                                  for c, runs in results.items()}},
                                        indent=1, default=str))


if __name__ == "__main__":
    main()
