"""Our trainer against TRL's GRPOTrainer: wall-clock and sampled tokens to a held-out accuracy threshold.

Four methods on the default recipe's task (multi-digit addition with a worked think, 64 new tokens), all
starting from ONE warm start (our SFT of the default recipe, saved with its char tokenizer in Hugging Face
format under --out, built once per settings and reused):
- flashreinforce: ours as shipped (`flashreinforce train arithmetic`): 128 prompts x 1 rollout per
  optimizer step, the stream scheduler generating one step ahead of training (async, max lag 1).
- grpo: ours (`flashreinforce train arithmetic_grpo`): 32 prompts x 4 rollouts, same scheduler.
- trl: TRL 1.16 GRPOTrainer: 32 prompts x 4 generations, one optimizer step per generation batch, generating
  with `model.generate`.
- trl-all-cores: the same with torch's default threads, all the machine's cores, for generation and training.
- flashreinforce-sync (only when named in --methods): ours with the sync scheduler (`arithmetic_sync`), each
  batch sampled by the weights that train on it: what the overlap costs in samples and gains in time.
TRL's other configurations: `--routes` tries each here (vs_trl_routes.py). Its asynchronous AsyncGRPOTrainer
and its vLLM generation, colocated or through a server, fail on a CPU.
Held fixed for all: T=1 / top-p 1 / top-k off, 64 new tokens, AdamW (betas 0.9/0.999, no weight
decay) at a constant lr 1e-4 with grad-norm clip 1, no KL, fp32 (`--precision bf16`: bf16 compute over fp32
weights and AdamW, generation included for ours; TRL's `bf16=True`), 128 trajectories per step. TRL tokenizes
the plain-text prompts with the same tokenizer (no BOS/EOS added; checked at start), stops on the same
<eos>, and its reward function decodes the sampled ids as we do and calls our math verifier.
Threads: `--threads N` sets torch's intra-op threads in every run but trl-all-cores. Ours runs its engine
thread and its trainer thread at the same time, N threads each; TRL generates and trains in turn in one
thread, N threads for each phase. On 2 cores, N=1 (our recipe's setting) leaves `trl` one idle core, which
trl-all-cores uses. Every held-out evaluation runs at N threads.
What differs, by design or by framework: our engine (continuous batching, overlapping the optimizer step,
verification in worker processes) vs TRL's `model.generate` (padded static batches) then training. TRL's
GRPO scales advantages by the unbiased group std (ours the population std). Seeds change the data order
and sampling streams (each framework its own); the warm start is shared.
Measured per run (its own process): held-out avg@k (our `evaluate` on our engine with the run's current
weights, T=1, the same prompts and per-sample seeds for every method) before RL and every --eval-every
steps; RL wall-clock from the first step with evaluation cut out (ours: the loop's `time/step_seconds`,
which excludes evaluation; TRL: a callback that stops the clock while it evaluates); sampled tokens (every
generated token incl. EOS, training rollouts only) and the tokens trained on (those of the rollouts the
evaluated weights learned from: ours has also sampled the batch it generates ahead, TRL trains on all it
sampled); steps/s and tokens/s over the whole run; peak RSS of
the run's processes together (sampled every 0.25 s: ours is the loop's process, whose engine and trainer
are threads, and its verifier workers; TRL one process; the JSON also has the largest single process's,
exact, from wait4).
Time and tokens to threshold are those at the first evaluation at or above it. The goal compares
FlashREINFORCE with the strongest TRL method (the one with the shortest median wall-clock to the threshold)
on time, and on the tokens trained on: sample efficiency, which the one batch an asynchronous run has
generated ahead at any moment does not change. The sampled-tokens ratio is printed beside it.

    python benchmarks/vs_trl.py                    # 3 seeds x 4 methods
    python benchmarks/vs_trl.py --threads 2 --png bench-out/vs_trl_threads2.png
    python benchmarks/vs_trl.py --quick            # ~2 minutes: tiny settings, 1 seed, proves the harness
    python benchmarks/vs_trl.py --routes           # which TRL configurations train here (needs .venv-vllm)
    flashreinforce bench vs-trl --seeds 0 1 --threshold 65 --json bench-out/vs_trl.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from machine import Machine
from vs_trl_task import (
    DEFAULT_METHODS,
    METHODS,
    RECIPES,
    TRL_METHODS,
    EvalPoint,
    Settings,
    WorkerSpec,
    curve_from_metrics,
    our_overrides,
    warm_start,
)

FULL = Settings(steps=150, max_seconds=600.0, threshold=70.0, eval_every=5, eval_prompts=256, eval_k=4,
                trajectories=128, group_size=4, max_new_tokens=64, lr=1e-4, grad_clip=1.0, threads=1,
                all_cores=len(os.sched_getaffinity(0)), sft_steps=400)
QUICK = replace(FULL, steps=4, max_seconds=60.0, eval_every=2, eval_prompts=16, eval_k=2, trajectories=16,
                sft_steps=30)
PAGE = os.sysconf("SC_PAGE_SIZE")
REPOSITORY = Path(__file__).resolve().parents[1]


# ---- running one method x seed in its own process ---------------------------------------------------


def _tree_rss(root: int) -> int:
    """Resident bytes of a process and all its descendants now (0 once it is gone)."""
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:  # exited while we looked
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = set(), [root]
    while frontier:
        pid = frontier.pop()
        tree.add(pid)
        frontier.extend(child for child, parent in parents.items() if parent == pid)
    total = 0
    for pid in tree:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        except OSError:
            continue
    return total


def _watch(command: list[str], log: Path, timeout_s: float) -> dict[str, float]:
    """Run a command to completion (its output to `log`), sampling its tree's memory; kill it on timeout."""
    started = time.perf_counter()
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        peak_tree = 0
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            peak_tree = max(peak_tree, _tree_rss(process.pid))
            if time.perf_counter() - started > timeout_s:
                os.killpg(process.pid, 9)
                _, status, usage = os.wait4(process.pid, 0)
                break
            time.sleep(0.25)
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: keep Popen from waiting again
    if process.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise RuntimeError(f"{' '.join(command[:6])} ... exited with {process.returncode} "
                           f"after {time.perf_counter() - started:.0f} s; end of {log}:\n{tail}")
    return {
        "peak_rss_mb": usage.ru_maxrss / 1024,  # KiB on Linux: the largest of the process and its waited children
        "peak_tree_rss_mb": peak_tree / 2**20,
        "process_seconds": time.perf_counter() - started,
        "load_average_after": os.getloadavg()[0],
    }


def run_one(method: str, settings: Settings, seed: int, warm_dir: Path, run_dir: Path) -> dict[str, Any]:
    run_dir.mkdir(parents=True)
    timeout = 3 * settings.max_seconds + 600
    if method in TRL_METHODS:
        spec = WorkerSpec(settings, method, seed, str(warm_dir), str(run_dir))
        spec.write(run_dir / "spec.json")
        measured = _watch([sys.executable, __file__, "--trl-worker", str(run_dir / "spec.json")],
                          run_dir / "log.txt", timeout)
        result = json.loads((run_dir / "result.json").read_text())
        points = [EvalPoint(**p) for p in result.pop("points")]
    else:
        command = [sys.executable, "-m", "flashreinforce", "train", RECIPES[method],
                   *our_overrides(method, settings, seed, warm_dir), "--output", str(run_dir)]
        measured = _watch(command, run_dir / "log.txt", timeout)
        points, result = curve_from_metrics(run_dir / "metrics.jsonl")
    return {"method": method, "seed": seed, "run_dir": str(run_dir), **result, **measured,
            "points": [asdict(p) for p in points]}


# ---- summary -----------------------------------------------------------------------------------------


def first_crossing(points: list[dict[str, Any]], threshold: float) -> dict[str, Any] | None:
    return next((p for p in points if p["accuracy"] >= threshold), None)


def _spread(values: list[float], fmt: str) -> str:
    """'median [min-max]'; a run that never reached the threshold counts as infinitely slow."""
    median = statistics.median(values)
    if math.isinf(median):
        return "not reached"
    low, high = min(values), max(values)
    text = format(median, fmt)
    if len(values) > 1:
        text += f" [{format(low, fmt)}–{'>cap' if math.isinf(high) else format(high, fmt)}]"
    return text


def summarize(runs: list[dict[str, Any]], threshold: float) -> dict[str, dict[str, Any]]:
    summary = {}
    for method in dict.fromkeys(r["method"] for r in runs):
        mine = [r for r in runs if r["method"] == method]
        hits = [first_crossing(r["points"], threshold) for r in mine]
        summary[method] = {
            "runs": len(mine),
            "reached": sum(h is not None for h in hits),
            "seconds_to_threshold": [h["seconds"] if h else math.inf for h in hits],
            "tokens_to_threshold": [h["sampled_tokens"] if h else math.inf for h in hits],
            "trained_tokens_to_threshold": [h["trained_tokens"] if h else math.inf for h in hits],
            "steps_to_threshold": [h["step"] if h else math.inf for h in hits],
            "steps_per_second": [r["steps"] / r["seconds"] for r in mine],
            "tokens_per_second": [r["sampled_tokens"] / r["seconds"] for r in mine],
            "peak_rss_mb": [r["peak_rss_mb"] for r in mine],
            "peak_tree_rss_mb": [r["peak_tree_rss_mb"] for r in mine],
            "final_accuracy": [r["points"][-1]["accuracy"] for r in mine],
            "initial_accuracy": [r["points"][0]["accuracy"] for r in mine],
        }
    return summary


def strongest_trl(summary: dict[str, dict[str, Any]]) -> str | None:
    """The TRL method with the shortest median wall-clock to the threshold; None when none reached it."""
    reached = {m: statistics.median(s["seconds_to_threshold"]) for m, s in summary.items() if m in TRL_METHODS}
    reached = {m: seconds for m, seconds in reached.items() if math.isfinite(seconds)}
    return min(reached, key=reached.__getitem__) if reached else None


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per TRL method, per method of ours: TRL's median time to threshold over ours, our median tokens (sampled;
    trained on) over TRL's.

    Empty for a pair when either median is "not reached" (no finite ratio to state).
    """
    keys = ("seconds_to_threshold", "tokens_to_threshold", "trained_tokens_to_threshold")
    medians = {m: [statistics.median(s[key]) for key in keys] for m, s in summary.items()}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for trl in (m for m in summary if m in TRL_METHODS):
        trl_time, trl_tokens, trl_trained = medians[trl]
        out[trl] = {}
        for method in (m for m in summary if m not in TRL_METHODS):
            time_, tokens, trained = medians[method]
            finite = all(math.isfinite(v) and v > 0 for v in (*medians[trl], *medians[method]))
            out[trl][method] = ({"speedup_vs_trl": trl_time / time_, "tokens_vs_trl": tokens / trl_tokens,
                                 "trained_tokens_vs_trl": trained / trl_trained} if finite else {})
    return out


def table(summary: dict[str, dict[str, Any]], settings: Settings) -> str:
    target = f"{settings.threshold:g}%"
    header = (f"| method | reached {target} | wall-clock to {target} (s) | sampled tokens to {target} "
              f"| tokens trained on to {target} | steps to {target} | steps/s | tokens/s "
              f"| peak RSS, all processes (MB) | avg@{settings.eval_k} at end |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for method, s in summary.items():
        lines.append(
            f"| {settings.label(method)} | {s['reached']}/{s['runs']} | {_spread(s['seconds_to_threshold'], '.1f')} "
            f"| {_spread(s['tokens_to_threshold'], ',.0f')} | {_spread(s['trained_tokens_to_threshold'], ',.0f')} "
            f"| {_spread(s['steps_to_threshold'], '.0f')} "
            f"| {_spread(s['steps_per_second'], '.2f')} | {_spread(s['tokens_per_second'], ',.0f')} "
            f"| {_spread(s['peak_tree_rss_mb'], '.0f')} | {_spread(s['final_accuracy'], '.1f')} |"
        )
    return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    """Strict JSON: a run that never reached the threshold is null, not Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def plot(runs: list[dict[str, Any]], settings: Settings, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"flashreinforce": "#1f77b4", "grpo": "#2ca02c", "trl": "#d62728", "trl-all-cores": "#ff7f0e",
              "flashreinforce-sync": "#9467bd"}
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for run in runs:
        label = settings.label(run["method"]) if run["seed"] == runs[0]["seed"] else None
        accuracy = [p["accuracy"] for p in run["points"]]
        style = {"color": colors[run["method"]], "alpha": 0.8, "linewidth": 1.2, "label": label}
        axes[0].plot([p["seconds"] for p in run["points"]], accuracy, **style)
        axes[1].plot([p["sampled_tokens"] / 1e6 for p in run["points"]], accuracy, **style)
    for axis, xlabel in zip(axes, ("RL wall-clock, evaluation excluded (s)", "sampled tokens (millions)")):
        axis.axhline(settings.threshold, color="#777777", linestyle="--", linewidth=0.8)
        axis.set_xlabel(xlabel)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel(f"held-out avg@{settings.eval_k} (%)")
    axes[0].legend(loc="lower right", fontsize=8)
    figure.suptitle(f"vs TRL: {len({r['seed'] for r in runs})} seed(s) per method, {settings.trajectories} "
                    f"trajectories per step, {settings.precision}, torch threads {settings.threads} "
                    f"(trl-all-cores {settings.all_cores}), "
                    f"threshold {settings.threshold:g}% dashed", fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


# ---- command line ------------------------------------------------------------------------------------


def parse_args() -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings, 1 seed: the harness end to end, ~2 min")
    parser.add_argument("--seeds", type=int, nargs="+", help="run seeds (default 0 1 2; --quick: 0)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(DEFAULT_METHODS),
                        help=f"default: {' '.join(DEFAULT_METHODS)}")
    parser.add_argument("--threshold", type=float, help=f"held-out avg@k to reach, percent (default {FULL.threshold:g})")
    parser.add_argument("--steps", type=int, help=f"optimizer steps per run (default {FULL.steps})")
    parser.add_argument("--max-seconds", type=float, help="RL wall-clock cap per run, evaluation excluded")
    parser.add_argument("--eval-every", type=int, help=f"steps between held-out evaluations (default {FULL.eval_every})")
    parser.add_argument("--threads", type=int,
                        help="torch intra-op threads in every run but trl-all-cores's training (default 1)")
    parser.add_argument("--precision", choices=("fp32", "bf16"),
                        help="every run's compute precision (default fp32; bf16: fp32 weights and AdamW, bf16 compute)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/vs_trl"),
                        help="warm starts and run directories go here")
    parser.add_argument("--png", type=Path, default=Path("bench-out/vs_trl.png"))
    parser.add_argument("--json", type=Path, help="also write every figure and curve to this file")
    parser.add_argument("--routes", action="store_true",
                        help="instead: try each TRL configuration here (vs_trl_routes.py), print which train")
    parser.add_argument("--vllm-python", type=Path, default=REPOSITORY / ".venv-vllm" / "bin" / "python",
                        help="--routes: the vLLM virtualenv's python, with TRL (default: .venv-vllm of this checkout)")
    parser.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)  # internal: one TRL run
    args = parser.parse_args()
    chosen = {"threshold": args.threshold, "steps": args.steps, "max_seconds": args.max_seconds,
              "eval_every": args.eval_every, "threads": args.threads, "precision": args.precision}
    try:
        settings = replace(QUICK if args.quick else FULL, **{k: v for k, v in chosen.items() if v is not None})
    except ValueError as error:
        parser.error(str(error))
    args.seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    return args, settings


GOAL_SPEEDUP = 1.5
"""FlashREINFORCE reaches the threshold at least this much sooner than the strongest TRL method, at <= 1x its
tokens trained on."""


def report(runs: list[dict[str, Any]], settings: Settings, warm_eval: dict[str, Any]) -> tuple[dict, dict, str | None]:
    """Print the markdown table, the ratios to each TRL method and the goal; return (summary, ratios, strongest)."""
    summary = summarize(runs, settings.threshold)
    speed, strongest = ratios(summary), strongest_trl(summary)
    print(f"\nwarm start: held-out avg@{warm_eval['k']} {warm_eval['eval/avg@k']:.1f}% on {warm_eval['num_prompts']} "
          f"prompts; {settings.trajectories} trajectories per optimizer step; {settings.precision} compute; "
          f"torch threads {settings.threads} in "
          f"every run (trl-all-cores: {settings.all_cores}); {len({r['seed'] for r in runs})} seed(s), "
          "median [range]\n")
    print(table(summary, settings))
    print()
    for trl, per_method in speed.items():
        for method, r in per_method.items():
            print(f"{settings.label(method)} vs {settings.label(trl)}: " + (
                f"reaches {settings.threshold:g}% {r['speedup_vs_trl']:.2f}x as fast, having trained on "
                f"{r['trained_tokens_vs_trl']:.3f}x its tokens and sampled {r['tokens_vs_trl']:.3f}x "
                "(ratios of the medians over seeds)" if r else "no comparison: not both reached"))
    goal = f"goal (FlashREINFORCE >= {GOAL_SPEEDUP:g}x as fast as the strongest TRL method"
    if strongest is not None and "flashreinforce" in summary:
        r = speed[strongest]["flashreinforce"]
        met = bool(r) and r["speedup_vs_trl"] >= GOAL_SPEEDUP and r["trained_tokens_vs_trl"] <= 1
        print(f"{goal}, {settings.label(strongest)}, at <= 1x its tokens trained on): {'met' if met else 'NOT met'}")
    elif "flashreinforce" in summary and any(m in TRL_METHODS for m in summary):
        print(f"{goal}): no comparison, no TRL method reached {settings.threshold:g}%")
    return summary, speed, strongest


def main() -> None:
    args, settings = parse_args()
    if args.trl_worker is not None:
        from vs_trl_trl import run_trl

        run_trl(WorkerSpec.read(args.trl_worker))
        return
    if args.routes:
        from vs_trl_routes import main_routes

        main_routes(settings, args.quick, args.out, args.vllm_python, args.json)
        return
    if any(method in TRL_METHODS for method in args.methods):
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            raise SystemExit("vs-trl needs TRL: pip install 'flashreinforce[trl]' (trl==1.16.0), "
                             "or leave it out with --methods flashreinforce grpo")
    import torch

    torch.set_num_threads(settings.threads)  # so the machine record shows the threads every run uses
    machine = Machine.measure()
    print(machine.describe())
    machine.warn_if_busy()
    started = time.perf_counter()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    warm_dir = warm_start(settings, out, sys.executable)
    warm_eval = json.loads((warm_dir.parent / "sft_eval.json").read_text())
    runs_dir = out / f"runs-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    runs = []
    for seed in args.seeds:  # seeds outermost: drifting machine load hits every method alike
        for method in args.methods:
            run = run_one(method, settings, seed, warm_dir, runs_dir / f"{method}-seed{seed}")
            hit = first_crossing(run["points"], settings.threshold)
            print(f"{method:>14} seed {seed}: {run['steps']} steps in {run['seconds']:.1f} s, "
                  f"avg@{settings.eval_k} {run['points'][0]['accuracy']:.1f} -> {run['points'][-1]['accuracy']:.1f}, "
                  + (f"{settings.threshold:g}% at step {hit['step']} ({hit['seconds']:.1f} s)" if hit
                     else f"{settings.threshold:g}% not reached") + f"; load {run['load_average_after']:.2f}",
                  flush=True)
            runs.append(run)
    summary, speed, strongest = report(runs, settings, warm_eval)
    total = time.perf_counter() - started
    print(f"\ntotal benchmark wall time {total:.0f} s; load average now {os.getloadavg()[0]:.2f}")
    plot(runs, settings, args.png)
    print(f"wrote {args.png}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_jsonable({
            "benchmark": "vs-trl",
            "command": sys.argv,
            "machine": machine.as_dict(),
            "settings": settings.as_json(),
            "seeds": args.seeds,
            "warm_start": {"dir": str(warm_dir), **warm_eval},
            "runs": runs,
            "summary": summary,
            "ratios": speed,
            "strongest_trl": strongest,
            "total_seconds": total,
        }), indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
