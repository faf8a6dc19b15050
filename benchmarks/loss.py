"""Forward+backward time of flashreinforce_loss: base path vs the entropy filter, on the CPU.

B = 128 rows; T in {1024, 8192}; float32 and bfloat16 log-probs; "base" is q = 1, "filter" is q = 0.9 with
half of the rows marked failed. Rows have random lengths in [T/2, T] and every row is admitted, so both
paths do all their work. Reports the median of several repetitions after warmup.

    python benchmarks/loss.py [--quick] [--json FILE] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

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
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice); 1 is steadier on a "
                        "busy machine, where every multi-threaded op waits for a descheduled thread")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    widths, repeats, warmup = ((256, 1024), 5, 1) if args.quick else ((1024, 8192), 15, 3)
    load = os.getloadavg()[0]
    machine = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_average_1m": load,
               "torch": torch.__version__}
    print(f"machine: {machine['cpu_count']} cores, {machine['torch_threads']} torch threads, "
          f"load average {load:.2f}, torch {torch.__version__}; B={BATCH}, median of {repeats} after {warmup} warmup")
    if load > 0.5:
        print(f"WARNING: load average {load:.2f} > 0.5: other work is running, timings are noisy "
              "(try --threads 1)")

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

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "batch": BATCH, "repeats": repeats, "warmup": warmup, "results": rows},
                      f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
