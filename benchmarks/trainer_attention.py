"""A bf16 training step on the CPU: the trainer's fp32 attention against torch's bf16 SDPA.

A bf16 trainer on a CPU attends in fp32 (flashreinforce/models/cpu_attention.py); "bf16 SDPA" is the same
trainer with its model switched back to transformers' plain "sdpa", as it trained before. One FlashREINFORCE
`Trainer.step` per round on one fixed batch, the two in turn (so a burst of other load hits both alike), medians
of the timed rounds after an untimed one each; models built from a config with random weights (no download):
- recipe: the default recipe's model (Qwen2, hidden 128, 2 layers, 4 heads, 18-token vocabulary), 128 rows of
  12-23 prompt and 15-49 sampled tokens, as the default recipe trains (microbatches of 2,048 tokens);
- smollm2: SmolLM2-135M's shapes (Llama, hidden 576, 30 layers, 9 heads over 3 KV heads, 49,152-token
  vocabulary), 32 rows of 57 prompt and 20 sampled tokens, microbatches of 8 rows, as the smollm2 recipe trains.

And the attention alone (`--kernels`): SDPA's forward and backward, causal, in bf16 against the same of fp32
copies cast back, over 4,096 positions a call in rows of 77-512 positions, 8 heads of width 32, 64 and 128; the
last column says which of the two the trainer runs at that shape (cpu_attention.UPCAST_LIMIT).

    python benchmarks/trainer_attention.py [--models recipe smollm2] [--rounds 5] [--threads 1] [--json FILE]
    python benchmarks/trainer_attention.py --kernels
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from machine import Machine

from flashreinforce.models.cpu_attention import FP32_SDPA, UPCAST_LIMIT
from flashreinforce.models.numerics import Numerics
from flashreinforce.trainer.trainer import OptimizerSettings, Trainer
from flashreinforce.types import Prompt, RolloutKey, Trajectory, Verdict


@dataclass(frozen=True)
class Workload:
    config: dict
    """The model's transformers config (random weights)."""
    rows: int
    prompt: tuple[int, int]
    """Prompt tokens a row, drawn from [low, high)."""
    sampled: tuple[int, int]
    """Sampled (trained) tokens a row, drawn from [low, high)."""
    microbatch_rows: int
    microbatch_tokens: int | None


WORKLOADS = {
    "recipe": Workload({"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 18,
                        "max_position_embeddings": 96, "tie_word_embeddings": True},
                       rows=128, prompt=(12, 24), sampled=(15, 50), microbatch_rows=128, microbatch_tokens=2048),
    "smollm2": Workload({"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                         "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                         "max_position_embeddings": 2048, "tie_word_embeddings": True},
                        rows=32, prompt=(57, 58), sampled=(20, 21), microbatch_rows=8, microbatch_tokens=None),
}


def build(name: str, quick: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    work = WORKLOADS[name]
    config = AutoConfig.for_model(**{**work.config, **({"num_hidden_layers": 2} if quick else {})})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    trainer = Trainer(model, loss="flashreinforce", loss_options={}, microbatch_size=work.microbatch_rows,
                      microbatch_tokens=work.microbatch_tokens, pad_token_id=0, temperature=1.0,
                      max_new_tokens=work.sampled[1], numerics=Numerics(precision="bf16"),
                      optimizer=OptimizerSettings(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=0,
                                                  total_steps=1000, min_lr_ratio=1.0, grad_clip=1.0))
    return trainer, batch(work.rows // 8 if quick else work.rows, work.prompt, work.sampled, config.vocab_size)


def batch(count: int, prompt: tuple[int, int], sampled: tuple[int, int], vocab: int) -> list[Trajectory]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(count):
        p, n = (int(torch.randint(low, high, (1,), generator=g)) for low, high in (prompt, sampled))
        mask = (0,) * p + (1,) * n
        rows.append(Trajectory(key=RolloutKey(f"p{i}", 0), prompt=Prompt(f"p{i}", "x", "y"), group=i,
                               tokens=tuple(torch.randint(2, vocab, (p + n,), generator=g).tolist()), loss_mask=mask,
                               behavior_logprobs=tuple(-3.0 * m for m in mask), policy_versions=(0,) * (p + n),
                               prompt_length=p, finish_reason="stop",
                               verdict=Verdict(reward=float(i % 3 == 0), passed=i % 3 == 0)))
    return rows


def measure(name: str, rounds: int, quick: bool) -> dict:
    trainer, rows = build(name, quick)
    if trainer.model.config._attn_implementation != FP32_SDPA:
        raise RuntimeError(f"the bf16 trainer did not switch to {FP32_SDPA}: nothing to compare")
    seconds: dict[str, list[float]] = {FP32_SDPA: [], "sdpa": []}
    for round_ in range(rounds + 1):  # round 0 untimed: allocations, oneDNN's kernel choices
        for attention, samples in seconds.items():
            trainer.model.set_attn_implementation(attention)
            started = time.perf_counter()
            trainer.step(rows)
            if round_:
                samples.append(time.perf_counter() - started)
    fp32, bf16 = (statistics.median(seconds[k]) for k in (FP32_SDPA, "sdpa"))
    return {"model": name, "rows": len(rows), "tokens": sum(len(r.tokens) for r in rows),
            "bf16 SDPA step s": bf16, "fp32 attention step s": fp32, "speedup": bf16 / fp32,
            "samples": seconds}


KERNEL_WIDTHS = (32, 64, 128)
KERNEL_POSITIONS = (77, 128, 256, 512)


def kernel_ms(positions: int, width: int, upcast: bool, rounds: int, total: int) -> float:
    """Median ms of one causal SDPA forward and backward over `total` positions in rows of `positions`, 8 heads."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(max(1, total // positions), 8, positions, width, generator=g, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))
    samples = []
    for round_ in range(rounds + 1):
        started = time.perf_counter()
        if upcast:
            out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
            out = out.to(torch.bfloat16)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.float().sum().backward()
        if round_:
            samples.append(1e3 * (time.perf_counter() - started))
    return statistics.median(samples)


def kernels(rounds: int, total: int) -> list[dict]:
    print("\n| head width | positions a row | bf16 ms | fp32 ms | bf16 / fp32 | the trainer runs |\n|---|---|---|---|---|---|")
    results = []
    for width in KERNEL_WIDTHS:
        for positions in KERNEL_POSITIONS:
            bf16, fp32 = (kernel_ms(positions, width, upcast, rounds, total) for upcast in (False, True))
            runs = "fp32" if positions * width <= UPCAST_LIMIT else "bf16"
            results.append({"head width": width, "positions": positions, "bf16 ms": bf16, "fp32 ms": fp32,
                            "trainer runs": runs})
            print(f"| {width} | {positions} | {bf16:.1f} | {fp32:.1f} | {bf16 / fp32:.2f}x | {runs} |")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(WORKLOADS), default=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the recipes' 1 by default)")
    parser.add_argument("--quick", action="store_true",
                        help="2 layers, an eighth of the rows, 1 round (--kernels: 1,024 positions): the harness")
    parser.add_argument("--kernels", action="store_true", help="instead: the attention alone, bf16 against fp32")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = Machine.measure()
    print(machine.describe())
    machine.warn_if_busy()
    if args.kernels:
        write(args.json, {"benchmark": "trainer_attention --kernels", "machine": machine.as_dict(),
                          "rounds": args.rounds, "results": kernels(*((1, 1024) if args.quick else (args.rounds, 4096)))})
        return
    results = [measure(name, 1 if args.quick else args.rounds, args.quick) for name in args.models]
    print("\n| model | rows | tokens | bf16 SDPA: step s | fp32 attention: step s | speedup |\n|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['rows']} | {r['tokens']:,} | {r['bf16 SDPA step s']:.3f} | "
              f"{r['fp32 attention step s']:.3f} | {r['speedup']:.2f}x |")
    write(args.json, {"benchmark": "trainer_attention", "machine": machine.as_dict(), "rounds": args.rounds,
                      "results": results})


def write(path: Path | None, report: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
