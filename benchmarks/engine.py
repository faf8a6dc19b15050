"""Useful tokens/s of the local engine vs `transformers` generate and a bare batched forward loop.

Workload: `--requests` prompts of `--prompt` tokens; 7 in 8 want `--short` new tokens (plus or minus
a quarter), 1 in 8 wants 8x as many: most requests short, a few long. At most `--batch` decode at
once. Only requested tokens count as useful; padding and tokens past a request's length do not.

- generate: `model.generate` on consecutive groups of `--batch` requests, sampling at temperature 1
  (top_k=0, top_p=1), each group running to the longest request in it (no EOS: lengths are budgets).
- engine:   all requests submitted to Engine(max_batch_size=--batch); slots refill as requests finish.
- bare:     a plain HF forward loop over the same tokens (DynamicCache, argmax, no sampling or
            bookkeeping), run by an oracle that knows every length: requests sorted by length, in
            waves of `--batch`, finished rows dropped from the batch at once.
engine overhead = bare tok/s / engine tok/s. The engine also reports its tok/s while every slot is
busy, before the queue runs dry and the last long requests drain.
Each method runs --repeats times, interleaved; the table shows the best run (least disturbed by other
processes on a shared machine) and the median.

    python benchmarks/engine.py                  # ~6M-parameter model, 256 requests, batch 64
    python benchmarks/engine.py --requests 64    # one batch: the engine's gain is the shrinking tail
    python benchmarks/engine.py --hidden 128 --layers 2 --batch 128 --short 24 --requests 512 --json out.json
    python benchmarks/engine.py --quick          # smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from machine import Machine
from transformers import DynamicCache

from flashreinforce.models import build_model
from flashreinforce.rollout import Engine
from flashreinforce.types import SamplingParams


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    """Prompts and per-request lengths: 1 in 8 is 8x longer, in a fixed shuffled order."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, args.vocab, (args.requests, args.prompt), generator=g).tolist()
    jitter = torch.randint(-args.short // 4, args.short // 4 + 1, (args.requests,), generator=g).tolist()
    lengths = [(8 if i % 8 == 7 else 1) * (args.short + j) for i, j in enumerate(jitter)]
    order = torch.randperm(args.requests, generator=g).tolist()
    return [prompts[i] for i in order], [lengths[i] for i in order]


def run_generate(model, prompts: list[list[int]], lengths: list[int], batch: int) -> dict:
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i : i + batch])
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max(lengths[i : i + batch]),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            eos_token_id=None,
            pad_token_id=0,
        )
    return {"seconds": time.perf_counter() - start}


def run_engine(model, prompts: list[list[int]], lengths: list[int], batch: int) -> dict:
    engine = Engine(model, max_batch_size=batch, max_context=len(prompts[0]) + max(lengths))
    start = time.perf_counter()
    for i, (prompt, length) in enumerate(zip(prompts, lengths)):
        engine.submit(str(i), prompt, SamplingParams(max_new_tokens=length, seed=i))
    generated, full_batch = 0, None
    while engine.has_work:
        generated += sum(len(g.token_ids) for g in engine.step())
        if full_batch is None and engine.num_waiting == 0 and engine.free_slots > 0:
            # The queue is dry: from here on slots empty out. Until here every slot was busy.
            full_batch = {"seconds": time.perf_counter() - start, "tokens": engine.stats.sampled_tokens}
    seconds = time.perf_counter() - start
    assert generated == sum(lengths), (generated, sum(lengths))
    return {
        "seconds": seconds,
        "slot_utilization": engine.stats.slot_utilization,
        "full_batch_tokens_per_second": full_batch["tokens"] / full_batch["seconds"],
    }


@torch.inference_mode()
def run_bare(model, prompts: list[list[int]], lengths: list[int], batch: int) -> dict:
    # An oracle that knows every length: waves of similar lengths, finished rows dropped at once.
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    start = time.perf_counter()
    for w in range(0, len(order), batch):
        wave = order[w : w + batch]
        remaining = torch.tensor([lengths[i] for i in wave])
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=torch.tensor([prompts[i] for i in wave]), cache=cache, use_cache=True).logits[:, -1]
        while bool((remaining := remaining - 1).any()):
            if not bool(remaining.all()):
                alive = remaining.nonzero().squeeze(1)
                cache.batch_select_indices(alive)
                logits, remaining = logits[alive], remaining[alive]
            logits = model(input_ids=logits.argmax(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1]
    return {"seconds": time.perf_counter() - start}


RUNNERS = {"generate": run_generate, "engine": run_engine, "bare": run_bare}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=8)
    parser.add_argument("--short", type=int, default=32, help="typical new tokens of a short request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--png", default="bench-out/engine.png", help="where to save the plot")
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run: tiny model, one batch, once")
    args = parser.parse_args()
    machine = Machine.measure()
    if args.quick:
        args.hidden, args.layers, args.requests, args.short, args.repeats = 64, 2, args.batch, 16, 1

    model = build_model(args.vocab, args.hidden, args.layers, args.heads, 8 * args.short * 2 + args.prompt).eval()
    params = sum(p.numel() for p in model.parameters())
    prompts, lengths = workload(args)
    for runner in RUNNERS.values():  # warm-up: first calls allocate and pick kernels
        runner(model, prompts[:8], [4] * 8, 8)
    runs: dict[str, list[dict]] = {name: [] for name in RUNNERS}
    for _ in range(args.repeats):
        for name, runner in RUNNERS.items():
            runs[name].append(runner(model, prompts, lengths, args.batch))

    rows = {}
    for name, results in runs.items():
        useful = sum(lengths)
        seconds = sorted(r["seconds"] for r in results)
        rows[name] = {
            "useful_tokens": useful,
            "best_seconds": seconds[0],
            "median_seconds": statistics.median(seconds),
            "tokens_per_second": useful / seconds[0],
            "median_tokens_per_second": useful / statistics.median(seconds),
        }
        if name == "engine":
            rows[name]["slot_utilization"] = results[0]["slot_utilization"]
            rows[name]["full_batch_tokens_per_second"] = max(r["full_batch_tokens_per_second"] for r in results)
    speedup = rows["engine"]["tokens_per_second"] / rows["generate"]["tokens_per_second"]
    overhead = rows["bare"]["tokens_per_second"] / rows["engine"]["tokens_per_second"]
    report = {
        "model": {"parameters": params, "hidden": args.hidden, "layers": args.layers, "heads": args.heads},
        "workload": {
            "requests": args.requests,
            "batch": args.batch,
            "prompt_tokens": args.prompt,
            "useful_tokens": sum(lengths),
            "padding_fraction_generate": 1 - sum(lengths) / sum(
                args.batch * max(lengths[i : i + args.batch]) for i in range(0, len(lengths), args.batch)
            ),
        },
        "machine": machine.as_dict(),
        "methods": rows,
        "engine_speedup_vs_generate": speedup,
        "engine_overhead_vs_bare": overhead,
    }
    print(machine.describe())
    machine.warn_if_busy()
    print(f"model {params / 1e6:.2f}M params (hidden {args.hidden}, {args.layers} layers), {args.requests} requests, "
          f"{args.batch} slots, {sum(lengths)} useful tokens, best of {args.repeats}\n")
    print("| method | useful tokens | best s | tok/s | median tok/s | slot utilization |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        util = f"{row['slot_utilization']:.0%}" if name == "engine" else "-"
        print(f"| {name} | {row['useful_tokens']} | {row['best_seconds']:.2f} | {row['tokens_per_second']:.0f} | "
              f"{row['median_tokens_per_second']:.0f} | {util} |")
    print(f"\nengine while all slots are busy: {rows['engine']['full_batch_tokens_per_second']:.0f} tok/s")
    print(f"engine vs generate: {speedup:.2f}x useful tokens/s (goal >= 3x); engine overhead vs bare loop: "
          f"{overhead:.2f}x (goal <= 1.5x)")
    plot(rows, args.png)
    print(f"wrote {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def plot(rows: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 3.5))
    names = list(rows)
    axis.bar(names, [rows[n]["tokens_per_second"] for n in names], color=["#999999", "#1f77b4", "#bbbbbb"])
    axis.set_ylabel("useful tokens / s (best run)")
    axis.set_title("long-tailed generation on the CPU")
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    main()
