"""Full fine-tuning vs LoRA: one Trainer.step on the same batch (step time, peak memory, push cost), and LoRA's
weight pushes, the merged model against the adapter alone (bytes and seconds).

Each configuration runs in a fresh interpreter (this script with --worker), so its peak resident memory
(VmHWM, the kernel's high-water mark of the process) is its own: model load, trainer build (optimizer,
adapters) and the steps, nothing left over from the other configuration. The model is SmolLM2-135M-Instruct
when `flashreinforce models get smollm2-135m-instruct` has cached it, else the default recipe's tiny model.
The batch: --rows random sequences of about --tokens tokens (lengths spread +-12%, a 16-token prompt),
groups of 4 with mixed rewards, trained with grpo in microbatches of --microbatch rows. One untimed step
first (AdamW allocates its state at its end, so the timed steps run with it), then --repeats timed steps;
the table shows the median. `push` is the time of trainer.weights(), what each weight push to the engine
costs: a state_dict for full fine-tuning, the merge W + scale * B @ A of every adapted layer for LoRA.
`RSS at end` is taken after the steps and that push, with the pushed state dict still held (for LoRA the
merged copies of the adapted weights).
Each method runs under two malloc settings (ALLOCATORS says why): RSS is what the allocator holds, not only
what the tensors need.

Pushes (--parts pushes): for each rank of --push-ranks, a LoRA trainer on the model takes one step, then pushes
to two local engines, one loading the merged model at every push (trainer.lora.push=merged) and one the adapter
alone after a first push with the base (push=adapter, the default), --push-repeats times each, in turn, a step
between rounds. Per push: the bytes it carries (a tied weight once: what a trainer process's shared memory, Ray's
object store or the weight group moves), the trainer's seconds to make it (the merge, or the adapter and its probe
forward) and the engine's to load it (copy and format, or merge and probe); medians.

    python benchmarks/lora.py                       # SmolLM2 if cached: 16 rows x ~128 tokens, microbatch 8
    python benchmarks/lora.py --r 8 --targets q_proj,v_proj --json bench-out/lora.json
    python benchmarks/lora.py --parts pushes --push-ranks 8,64 --json bench-out/lora_pushes.json
    python benchmarks/lora.py --quick               # smoke run, seconds: tiny model, 4 rows x ~32 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from machine import Machine

METHODS = ("full", "lora")
ALLOCATORS = {"mmap": {"MALLOC_MMAP_THRESHOLD_": "131072"}, "glibc": {}}
"""mmap: glibc serves every block over 128 KiB by mmap and returns it on free, so RSS follows the live tensors.
glibc: its default, whose threshold adapts upwards and keeps freed activation blocks in the heap, so the peak
also depends on the order of allocations (measured on SmolLM2, one microbatch: RSS after a LoRA step 3.6 GB
with the default, 1.1 GB with mmap). Both are reported: the first compares the configurations, the second is
what a run with the default allocator holds."""
REAL_MODEL = Path.home() / ".cache" / "flashreinforce" / "models" / "smollm2-135m-instruct"
PROMPT = 16


def _kib(field: str) -> float:
    """A VmHWM / VmRSS line of /proc/self/status in MB (Linux); the rusage maximum elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load(args: argparse.Namespace) -> tuple[torch.nn.Module, str]:
    """The real model when cached (and not --quick), else the default recipe's tiny one."""
    if not args.quick and args.model.is_dir():
        from flashreinforce.run.policy import load_policy

        return load_policy(args.model).model, args.model.name
    from flashreinforce.models import build_model

    hidden, layers = (32, 1) if args.quick else (128, 2)
    return build_model(64, hidden, layers, 4, 256, seed=0), f"tiny (hidden {hidden}, {layers} layers)"


def batch(args: argparse.Namespace, vocab: int) -> list:
    from flashreinforce.types import FORCED_VERSION, Prompt, RolloutKey, Trajectory, Verdict

    g = torch.Generator().manual_seed(0)
    spread = max(args.tokens // 8, 1)
    rows = []
    for i in range(args.rows):
        n = args.tokens + int(torch.randint(-spread, spread + 1, (1,), generator=g))
        tokens = tuple(torch.randint(1, vocab, (n,), generator=g).tolist())
        mask = tuple(int(j >= PROMPT) for j in range(n))
        reward = float(i % 2)
        rows.append(Trajectory(
            key=RolloutKey(f"p{i // 4}", i % 4), prompt=Prompt(f"p{i // 4}", "x", "y"), group=i // 4, tokens=tokens,
            loss_mask=mask, behavior_logprobs=tuple(-10.0 * m for m in mask),
            policy_versions=tuple(0 if m else FORCED_VERSION for m in mask), prompt_length=PROMPT,
            finish_reason="stop", verdict=Verdict(reward=reward, passed=reward > 0)))
    return rows


def build(args: argparse.Namespace, method: str, model: torch.nn.Module):
    from flashreinforce.trainer.lora import LoraSettings
    from flashreinforce.trainer.trainer import OptimizerSettings, Trainer

    lora = None
    if method == "lora":
        targets = args.targets if args.targets == "all-linear" else tuple(args.targets.split(","))
        lora = LoraSettings(r=args.r, alpha=2.0 * args.r, target_modules=targets)
    return Trainer(model, loss="grpo", loss_options={}, microbatch_size=args.microbatch, pad_token_id=0,
                   temperature=1.0, max_new_tokens=args.tokens, lora=lora,
                   optimizer=OptimizerSettings(lr=1e-5, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=0,
                                               total_steps=100, min_lr_ratio=1.0, grad_clip=1.0))


def worker(args: argparse.Namespace) -> dict:
    """One configuration in this process: build, one untimed step, --repeats timed ones, one push."""
    torch.set_num_threads(args.threads)
    model, name = load(args)
    params = sum(p.numel() for p in model.parameters())
    rows = batch(args, model.config.vocab_size)
    trainer = build(args, args.worker, model)
    trainable = sum(p.numel() for p in trainer.masters.params)
    built_mb = _kib("VmRSS")
    started = time.perf_counter()
    trainer.step(rows)
    first = time.perf_counter() - started
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        trainer.step(rows)
        times.append(time.perf_counter() - started)
    started = time.perf_counter()
    weights = trainer.weights()
    push = time.perf_counter() - started
    assert sum(t.numel() for t in weights.values()) >= params  # the full model (tied weights listed twice)
    return {"method": args.worker, "allocator": args.allocator, "model": name, "params": params,
            "trainable_params": trainable,
            "first_step_seconds": first, "step_seconds": statistics.median(times), "step_times": times,
            "push_seconds": push, "rss_after_build_mb": built_mb, "rss_at_end_mb": _kib("VmRSS"),
            "peak_rss_mb": _kib("VmHWM")}


def push_bytes(state: dict) -> int:
    from flashreinforce.rollout.weight_broadcast import tied_names

    tied = tied_names(state)
    return sum(t.numel() * t.element_size() for name, t in state.items() if name not in tied)


def push_rows(args: argparse.Namespace, rank: int) -> list[dict]:
    """Merged and adapter pushes of a rank-`rank` LoRA trainer into two engines, measured as the module says."""
    import copy

    from flashreinforce.rollout.engine import Engine

    model, _ = load(args)
    engines = {push: Engine(copy.deepcopy(model), max_batch_size=1, max_context=64) for push in ("merged", "adapter")}
    args = copy.copy(args)  # a copy: the report's settings keep the steps part's --r, not the last push rank
    args.r = rank
    trainer = build(args, "lora", model)
    rows = batch(args, model.config.vocab_size)
    trainer.step(rows)
    engines["adapter"].load_weights(trainer.push_state(base=True), trainer.version)  # the base, once
    kept: dict[str, dict[str, list[float]]] = {push: {"bytes": [], "trainer": [], "engine": []} for push in engines}
    for _ in range(args.push_repeats):
        trainer.step(rows)
        for push, engine in engines.items():
            started = time.perf_counter()
            state = trainer.weights() if push == "merged" else trainer.push_state(base=False)
            made = time.perf_counter()
            engine.load_weights(state, trainer.version)
            kept[push]["trainer"].append(made - started)
            kept[push]["engine"].append(time.perf_counter() - made)
            kept[push]["bytes"].append(push_bytes(state))
    out = []
    for push, times in kept.items():
        trainer_s, engine_s = statistics.median(times["trainer"]), statistics.median(times["engine"])
        out.append({"r": rank, "push": push, "MB": times["bytes"][-1] / 2**20, "trainer s": trainer_s,
                    "engine s": engine_s, "push s": trainer_s + engine_s})
    return out


def pushes_table(rows: list[dict]) -> str:
    lines = ["| r | push | MB | trainer s | engine s | push s |", "|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {row['r']} | {row['push']} | {row['MB']:,.2f} | {row['trainer s']:.3f} | {row['engine s']:.3f} | "
              f"{row['push s']:.3f} |" for row in rows]
    return "\n".join(lines)


def run_fresh(method: str, allocator: str, argv: list[str]) -> dict:
    """A worker in a fresh interpreter; its result is the last line it prints."""
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", method, "--allocator", allocator]
    environment = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    done = subprocess.run(command, check=True, capture_output=True, text=True,
                          env={**environment, **ALLOCATORS[allocator], "TOKENIZERS_PARALLELISM": "false"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The settings as flags for a worker (--quick's sizes are already in them)."""
    argv = [f"--model={args.model}", f"--rows={args.rows}", f"--tokens={args.tokens}",
            f"--microbatch={args.microbatch}", f"--r={args.r}", f"--targets={args.targets}",
            f"--repeats={args.repeats}", f"--threads={args.threads}"]
    return [*argv, "--quick"] if args.quick else argv


def table(rows: list[dict]) -> str:
    lines = [("| method | malloc | trainable params | step (s, median) | first step (s) | push: weights() (s) | "
              "RSS after build (MB) | RSS at end (MB) | peak RSS (MB) |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        share = 100 * row["trainable_params"] / row["params"]
        lines.append(f"| {row['method']} | {row['allocator']} | {row['trainable_params']:,} ({share:.2f}%) | "
                     f"{row['step_seconds']:.2f} | {row['first_step_seconds']:.2f} | {row['push_seconds']:.3f} | "
                     f"{row['rss_after_build_mb']:,.0f} | {row['rss_at_end_mb']:,.0f} | "
                     f"{row['peak_rss_mb']:,.0f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REAL_MODEL, help="a Hugging Face model directory")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128, help="mean tokens per row (prompt included)")
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--r", type=int, default=16, help="LoRA rank (alpha = 2r)")
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                        help="comma-separated LoRA target names, or all-linear")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps after the untimed first one")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny model, 4 rows x ~32 tokens")
    parser.add_argument("--parts", default="steps,pushes", help="steps (full vs LoRA), pushes (merged vs adapter)")
    parser.add_argument("--push-ranks", default="8,64", help="comma-separated LoRA ranks the pushes part measures")
    parser.add_argument("--push-repeats", type=int, default=5, help="pushes of each kind per rank")
    parser.add_argument("--allocators", help="comma-separated malloc settings to run each method under, of "
                                             f"{', '.join(ALLOCATORS)} (default: all; mmap with --quick)")
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--allocator", choices=tuple(ALLOCATORS), default="mmap", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick and args.worker is None:
        args.rows, args.tokens, args.microbatch, args.repeats, args.r = 4, 32, 2, 1, 4
        args.push_ranks, args.push_repeats = "4,8", 2
    args.parts = args.parts.split(",")
    args.allocators = args.allocators or ("mmap" if args.quick else ",".join(ALLOCATORS))
    unknown = set(args.allocators.split(",")) - set(ALLOCATORS)
    if unknown:
        parser.error(f"--allocators: {', '.join(sorted(unknown))} unknown; choose from {', '.join(ALLOCATORS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    torch.set_num_threads(args.threads)
    machine = Machine.measure()  # before any work: the load average of other processes
    print(machine.describe())
    machine.warn_if_busy()
    started = time.perf_counter()
    rows = [run_fresh(method, allocator, worker_argv(args))
            for allocator in args.allocators.split(",") for method in METHODS] if "steps" in args.parts else []
    if rows:
        print(f"model {rows[0]['model']} ({rows[0]['params']:,} parameters), {args.rows} rows x ~{args.tokens} "
              f"tokens, microbatch {args.microbatch}, LoRA r={args.r} on {args.targets}, {args.threads} thread(s); "
              f"wall {time.perf_counter() - started:.0f} s")
        print(table(rows))
    pushes = [row for rank in args.push_ranks.split(",") for row in push_rows(args, int(rank))] \
        if "pushes" in args.parts else []
    if pushes:
        print(f"\npushes: merged model vs adapter alone, {args.push_repeats} of each per rank (medians), on "
              f"{args.targets}\n{pushes_table(pushes)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine.as_dict(), "settings": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
            if k not in ("json", "worker", "allocator")},
            "rows": rows, "pushes": pushes}, indent=2))


if __name__ == "__main__":
    main()
