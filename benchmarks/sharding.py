"""Data-parallel trainer ranks replicated against FSDP-sharded, side by side: memory per rank and step time.

    python benchmarks/sharding.py                                   # a 2-rank group, ~27M parameters, 3 steps
    python benchmarks/sharding.py --hidden 1024 --layers 12 --world-size 2 --out bench-out/sharding-big
    python benchmarks/sharding.py --lora 16                         # LoRA adapters (peft) on a frozen base

For each of trainer.sharding=replicate and fsdp: `--world-size` trainer rank processes (trainer/group.py, gloo on
this machine's CPUs) built by the run's own factory (run/learner.py) from one tiny Qwen2-style model, then
`--steps` optimizer steps on the same synthetic learner batches (rows of random tokens, half rewarded, the
behavior log-probs the initial model's own so the trust region keeps every row). Per sharding:
    peak RSS MB      the largest peak resident memory (VmHWM) of any rank process: weights, gradients, AdamW
                     state, activations, the interpreter with torch, and rank 0's map of the published weights
    anon MB          the largest private memory (RssAnon) of any rank after the steps: what the rank itself
                     allocated and still holds (freed memory the allocator keeps counts too)
    state MB         computed, not measured: what the model's weights, their gradients and AdamW's two moments
                     take in fp32 on one replica (16 bytes a parameter), and that over world_size for a shard;
                     with --lora the frozen base takes 4 bytes a parameter and only the adapters 16
    step s           the median time of a step (generation excluded: the batch is given)
    max |Δw|         the largest difference of any weight from the replicated group's after the last step
                     (they compute the same step: FSDP sums the ranks' gradients as the all-reduce does)
A table is printed and written with a PNG and results.json to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from machine import Machine

from flashreinforce.config import load_config
from flashreinforce.models import build_model
from flashreinforce.models.logprobs import token_logprobs
from flashreinforce.run.learner import build_rank_trainer
from flashreinforce.trainer.group import TrainerGroup
from flashreinforce.trainer.lora import DEFAULT_TARGETS, linear_layers, resolve_targets
from flashreinforce.types import FORCED_VERSION, Prompt, RolloutKey, Trajectory, Verdict

PROMPT_TOKENS = 16


@dataclass(frozen=True)
class ShardingRun:
    sharding: str
    world_size: int
    lora_rank: int
    parameters: int
    peak_rss_mb: float
    anon_mb: float
    state_mb: float
    step_seconds: float
    max_weight_gap: float


def synthetic_batch(model: torch.nn.Module, rows: int, length: int, vocab: int, seed: int) -> list[Trajectory]:
    """Rows of random tokens of varied lengths, every other one rewarded, with the model's own log-probs."""
    g = torch.Generator().manual_seed(seed)
    batch = []
    for i in range(rows):
        n = length // 2 + int(torch.randint(0, length // 2 + 1, (1,), generator=g))
        tokens = torch.randint(1, vocab, (1, n), generator=g)
        mask = tuple(int(j >= PROMPT_TOKENS) for j in range(n))
        with torch.no_grad():
            logprobs, _ = token_logprobs(model, tokens, with_entropy=False)
        batch.append(Trajectory(
            key=RolloutKey(f"p{i}", 0), prompt=Prompt(id=f"p{i}", prompt="x", ground_truth="1"), group=i,
            tokens=tuple(tokens[0].tolist()), loss_mask=mask,
            behavior_logprobs=tuple(float(lp) * m for lp, m in zip(logprobs[0], mask)),
            policy_versions=tuple(0 if m else FORCED_VERSION for m in mask), prompt_length=PROMPT_TOKENS,
            finish_reason="stop", verdict=Verdict(reward=float(i % 2), passed=i % 2 == 1)))
    return batch


def memory_mb(pid: int, field: str) -> float:
    """A field of /proc/<pid>/status (VmHWM, RssAnon, ...) in MB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) / 1024


def run_group(sharding: str, args: argparse.Namespace, batches: list[list[Trajectory]],
              model: torch.nn.Module) -> tuple[ShardingRun, dict[str, torch.Tensor]]:
    config = load_config(None, [f"trainer.world_size={args.world_size}", f"trainer.sharding={sharding}",
                                f"trainer.microbatch_size={args.microbatch}", f"rollout.max_new_tokens={args.length}",
                                "trainer.lr=1e-4", *([f"trainer.lora={{r: {args.lora}}}"] if args.lora else [])])
    tokenizer = SimpleNamespace(pad_token_id=0)  # all the trainer reads of a tokenizer
    group = TrainerGroup(build_rank_trainer, (config, model, tokenizer), world_size=args.world_size,
                         backend="gloo", threads=args.threads,
                         sharded=sharding == "fsdp")
    try:
        seconds = []
        for batch in batches:
            started = time.perf_counter()
            group.step(batch)
            seconds.append(time.perf_counter() - started)
        weights = {name: tensor.clone() for name, tensor in group.weights().items()}
        rss = max(memory_mb(rank._proc.pid, "VmHWM") for rank in group.ranks)
        anon = max(memory_mb(rank._proc.pid, "RssAnon") for rank in group.ranks)
    finally:
        group.close()
    parameters = sum(p.numel() for p in model.parameters())
    state_mb = state_bytes(model, args.lora) / 2**20 / (args.world_size if sharding == "fsdp" else 1)
    run = ShardingRun(sharding, args.world_size, args.lora, parameters, rss, anon, state_mb,
                      statistics.median(seconds), 0.0)
    return run, weights


def state_bytes(model: torch.nn.Module, lora_rank: int) -> int:
    """fp32 weights, gradients and AdamW moments of what trains; with LoRA, the frozen base's weights alone and
    rank * (in + out) adapter parameters on each adapted layer."""
    parameters = sum(p.numel() for p in model.parameters())
    if not lora_rank:
        return 16 * parameters
    linears = linear_layers(model)
    adapters = sum(lora_rank * (linears[name].in_features + linears[name].out_features)
                   for name in resolve_targets(model, DEFAULT_TARGETS))
    return 4 * parameters + 16 * adapters


def table(runs: list[ShardingRun]) -> str:
    lines = ["| sharding | LoRA r | ranks | parameters | peak RSS MB (max rank) | anon MB after (max rank) | "
             "state MB / rank (computed) | step s (median) | max abs weight gap vs replicate |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r.sharding} | {r.lora_rank or '-'} | {r.world_size} | {r.parameters / 1e6:.1f}M | "
                     f"{r.peak_rss_mb:.0f} | {r.anon_mb:.0f} | {r.state_mb:.0f} | {r.step_seconds:.2f} | "
                     f"{r.max_weight_gap:.2e} |")
    return "\n".join(lines)


def plot(runs: list[ShardingRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.sharding for r in runs]
    figure, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    axes[0].bar(labels, [r.anon_mb for r in runs], color="tab:blue")
    axes[0].set_title("private memory of a rank after the steps (MB)")
    axes[1].bar(labels, [r.step_seconds for r in runs], color="tab:orange")
    axes[1].set_title("step time (s, median)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8, help="rows of a learner batch")
    parser.add_argument("--length", type=int, default=128, help="longest row, tokens")
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--lora", type=int, default=0, help="train LoRA adapters of this rank (0: every weight)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/sharding"))
    args = parser.parse_args(argv)
    machine = Machine.measure()
    print(machine.describe())
    machine.warn_if_busy()
    model = build_model(args.vocab, args.hidden, args.layers, max(1, args.hidden // 64),
                        max(256, args.length + PROMPT_TOKENS), seed=0)
    batches = [synthetic_batch(model, args.rows, args.length, args.vocab, seed) for seed in range(args.steps)]
    replicate, reference = run_group("replicate", args, batches, model)
    fsdp, weights = run_group("fsdp", args, batches, model)
    gap = max(float((weights[name] - tensor).abs().max()) for name, tensor in reference.items())
    runs = [replicate, ShardingRun(**{**asdict(fsdp), "max_weight_gap": gap})]
    markdown = table(runs)
    print(markdown)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(markdown + "\n")
    (args.out / "results.json").write_text(json.dumps({"machine": machine.as_dict(), "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "runs": [asdict(r) for r in runs]},
        indent=2))
    plot(runs, args.out / "sharding.png")
    print(f"wrote {args.out}/table.md, results.json, sharding.png")
    if not math.isfinite(gap):
        raise SystemExit("the sharded group's weights are not finite")


if __name__ == "__main__":
    main()
