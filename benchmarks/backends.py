"""The Ray backend against the local one on the default recipe: steps/s, the overhead per step, the start-up.

    python benchmarks/backends.py                       # 60 RL steps per backend, local and ray alternating
    python benchmarks/backends.py --steps 300 --repeats 2 --out bench-out/backends-full

Each run is `flashreinforce train` (the default recipe, SFT warm start included) in a subprocess, as a user runs
it, with held-out evaluation only before and after and no checkpoints in between; the runs alternate between the
backends so a change in the machine's load hits both. From each run's metrics.jsonl:
    steps/s             RL optimizer steps / the RL phase's wall time (sum of time/step_seconds)
    step ms (median)    the median of time/step_seconds: one learner batch, generation to optimizer step
    overhead / step     the backend's median step minus the local backend's, same repeat
    start s             wall time before the first step (interpreter, SFT warm start, actors, first eval)
and the held-out accuracy before and after, so a fast backend that stopped learning shows. A table is printed and
written with a PNG to --out. Needs the ray extra (pip install -e '.[ray]').
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from machine import Machine


@dataclass(frozen=True)
class BackendRun:
    backend: str
    repeat: int
    wall_seconds: float
    rl_seconds: float
    steps: int
    step_ms_median: float
    initial_accuracy: float
    final_accuracy: float

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.rl_seconds

    @property
    def start_seconds(self) -> float:
        """Everything before and after the RL phase: start-up, SFT, the two evaluations, shutdown."""
        return self.wall_seconds - self.rl_seconds


def run_once(backend: str, repeat: int, steps: int, out: Path, extra: list[str]) -> BackendRun:
    run_dir = out / f"{backend}-{repeat}"
    command = [sys.executable, "-m", "flashreinforce", "train", "--output", str(run_dir), f"backend.kind={backend}",
               f"trainer.steps={steps}", "eval.every=0", "trainer.checkpoint_every=0", "log.progress=false",
               "log.tensorboard=false", *extra]
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_seconds = [row["time/step_seconds"] for row in rows if "time/step_seconds" in row]
    summary = json.loads((run_dir / "summary.json").read_text())
    return BackendRun(backend, repeat, wall, sum(step_seconds), len(step_seconds),
                      1000 * statistics.median(step_seconds), summary["initial_accuracy"],
                      summary["final_accuracy"])


def table(runs: list[BackendRun]) -> str:
    local = {r.repeat: r for r in runs if r.backend == "local"}
    lines = ["| backend | repeat | steps/s | step ms (median) | overhead / step ms | start s | wall s | held-out |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        base = local.get(r.repeat)
        overhead = f"{r.step_ms_median - base.step_ms_median:+.1f}" if base and r is not base else "-"
        lines.append(f"| {r.backend} | {r.repeat} | {r.steps_per_second:.2f} | {r.step_ms_median:.0f} | {overhead} | "
                     f"{r.start_seconds:.1f} | {r.wall_seconds:.1f} | {r.initial_accuracy:.1f}% → "
                     f"{r.final_accuracy:.1f}% |")
    return "\n".join(lines)


def plot(runs: list[BackendRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.backend} #{r.repeat}" for r in runs]
    figure, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(labels, [r.steps_per_second for r in runs], color="tab:blue")
    axes[0].set_title("RL steps/s")
    axes[1].bar(labels, [r.start_seconds for r in runs], color="tab:orange")
    axes[1].set_title("start-up + evals + shutdown (s)")
    for axis in axes:
        axis.tick_params(axis="x", rotation=30)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="RL optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=1, help="alternating (local, ray) pairs")
    parser.add_argument("--out", type=Path, default=Path("bench-out/backends"))
    parser.add_argument("overrides", nargs="*", help="extra dotted overrides for every run (e.g. sft.steps=50)")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("ray") is None:
        sys.exit("benchmarks/backends.py compares backend.kind=ray with local: pip install -e '.[ray]' first")
    machine = Machine.measure()
    print(machine.describe())
    machine.warn_if_busy()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [run_once(backend, repeat, args.steps, args.out, args.overrides)
            for repeat in range(args.repeats) for backend in ("local", "ray")]
    markdown = table(runs)
    print(markdown)
    (args.out / "table.md").write_text(markdown + "\n")
    (args.out / "results.json").write_text(json.dumps({"machine": machine.as_dict(), "steps": args.steps,
                                                       "runs": [asdict(r) for r in runs]}, indent=2))
    plot(runs, args.out / "backends.png")
    print(f"wrote {args.out}/table.md, results.json, backends.png")


if __name__ == "__main__":
    main()
