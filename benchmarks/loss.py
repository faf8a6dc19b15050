"""Forward+backward time of flashreinforce_loss: base path vs the entropy filter, on the CPU.

B = 128 rows; T in {1024, 8192}; float32 and bfloat16 log-probs; "base" is q = 1, "filter" is q = 0.9 with
half of the rows marked failed. Rows have random lengths in [T/2, T] and every row is admitted, so both
paths do all their work. Reports the median of several repetitions after warmup.

    python benchmarks/loss.py [--quick] [--json FILE] [--png FILE] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pathlib import Path

import torch
from machine import Machine

from flashreinforce import flashreinforce_loss

BATCH = 128
FILTER_FRACTION = 0.9


def make_inputs(width: int, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 2, width + 1, (BATCH,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]  # (B, T)
    current = (-torch.rand(BATCH, width, generator=g) * 3).to(dtype)  # (B, T)
    behavior = (current.float() + 1e-3 * torch.randn(BATCH, width, generator=g)).clamp(max=0).to(dtype)
    return dict(
        current=current,
        behavior=behavior,
        rewards=torch.randint(0, 2, (BATCH,), generator=g).float(),
        mask=mask,
        entropies=torch.rand(BATCH, width, generator=g) * 4,
        failures=torch.arange(BATCH) % 2 == 0,  # half the rows failed
    )


def time_paths(inputs: dict, repeats: int, warmup: int) -> tuple[float, float]:
    """Median milliseconds of one forward + backward: (base, filter). The two paths alternate, so a burst of
    other load on the machine hits both alike."""
    timings = {1.0: [], FILTER_FRACTION: []}
    for i in range(warmup + repeats):
        for fraction, samples in timings.items():
            current = inputs["current"].clone().requires_grad_()
            start = time.perf_counter()
            loss, _ = flashreinforce_loss(current, inputs["behavior"], inputs["rewards"], inputs["mask"], delta=1.0,
                                          negative_token_fraction=fraction, entropies=inputs["entropies"],
                                          failures=inputs["failures"])
            loss.backward()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                samples.append(elapsed * 1e3)
    return statistics.median(timings[1.0]), statistics.median(timings[FILTER_FRACTION])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T in {256, 1024}, fewer repetitions")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    parser.add_argument("--png", metavar="FILE", default="bench-out/loss.png", help="where to save the plot")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice); 1 is steadier on a "
                        "busy machine, where every multi-threaded op waits for a descheduled thread")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    widths, repeats, warmup = ((256, 1024), 5, 1) if args.quick else ((1024, 8192), 15, 3)
    machine = Machine.measure()
    print(f"{machine.describe()}\nB={BATCH}, median of {repeats} after {warmup} warmup")
    machine.warn_if_busy()

    rows = []
    print("\n| T | dtype | path | ms fwd+bwd | ratio filter/base |\n|---|---|---|---|---|")
    for width in widths:
        for dtype in (torch.float32, torch.bfloat16):
            inputs = make_inputs(width, dtype)
            base, filtered = time_paths(inputs, repeats, warmup)
            name = str(dtype).removeprefix("torch.")
            print(f"| {width} | {name} | base | {base:.2f} | |")
            print(f"| {width} | {name} | filter q={FILTER_FRACTION} | {filtered:.2f} | {filtered / base:.2f} |")
            rows.append({"T": width, "dtype": name, "base_ms": base, "filter_ms": filtered,
                         "ratio_filter_over_base": filtered / base})

    plot(rows, args.png)
    print(f"\nwrote {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine.as_dict(), "batch": BATCH, "repeats": repeats, "warmup": warmup,
                       "results": rows}, f, indent=2)
        print(f"wrote {args.json}")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"T={r['T']}\n{r['dtype']}" for r in rows]
    x = range(len(rows))
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.bar([i - 0.2 for i in x], [r["base_ms"] for r in rows], width=0.4, label="base (q=1)")
    axis.bar([i + 0.2 for i in x], [r["filter_ms"] for r in rows], width=0.4, label=f"entropy filter (q={FILTER_FRACTION})")
    axis.set_xticks(list(x), labels)
    axis.set_ylabel("ms forward + backward (B=128)")
    axis.set_yscale("log")
    axis.set_title("flashreinforce_loss on the CPU")
    axis.legend()
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    main()
