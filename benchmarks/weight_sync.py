"""How long a weight push of the Ray backend takes: the object store against the weight group's broadcast.

    python benchmarks/weight_sync.py                                    # ~75M parameters, 2 engines, 5 pushes twice
    python benchmarks/weight_sync.py --hidden 1024 --layers 12 --engines 3 --pushes 10 --out bench-out/ws-big

For each of backend.weight_sync=object_store and broadcast (gloo on this machine: NCCL needs every side on a GPU),
a Ray backend of `--engines` engine actors and one trainer rank is started on a local Ray with one tiny
Qwen2-style model, and `--pushes` pushes of rank 0's weights are timed (RayBackend.push_seconds: from the call to
the last engine's answer, rank 0's read of its weights included), after one untimed push that builds the weight
group and warms both paths. The modes alternate `--repeats` times so a change in the machine's load hits both.
Every engine's weights are checked against rank 0's after the last push. A table is printed and written with a
PNG and results.json to --out. Needs the ray extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import ray
import torch
from machine import Machine

from flashreinforce.config import load_config
from flashreinforce.controller.ray_backend import RayParts, start_ray, start_ray_backend
from flashreinforce.run.backends import build_ray_trainer, ray_settings, verifier_options
from flashreinforce.run.engines import EngineShape, build_engine
from flashreinforce.run.policy import tiny_policy

MODES = ("object_store", "broadcast")


@dataclass(frozen=True)
class PushRun:
    weight_sync: str
    repeat: int
    engines: int
    parameters: int
    megabytes: float
    """The pushed state dict's size (fp32)."""
    push_seconds: list[float]

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.push_seconds)


def time_pushes(mode: str, repeat: int, args: argparse.Namespace) -> PushRun:
    config = load_config(None, [
        "backend.kind=ray", f"backend.num_engines={args.engines}", f"backend.weight_sync={mode}",
        f"model.tiny.hidden_size={args.hidden}", f"model.tiny.num_layers={args.layers}",
        f"model.tiny.num_heads={max(1, args.hidden // 64)}", "verifier.min_workers=1", "verifier.max_workers=1"])
    policy = tiny_policy(config)
    parts = RayParts(build_engine=build_engine, build_trainer=build_ray_trainer,
                     verifier_options=verifier_options(config, workers=1), config=config, policy=policy,
                     shape=EngineShape(32, 16, 0, 0))
    loop = asyncio.new_event_loop()
    backend = start_ray_backend(ray_settings(config), parts)
    try:
        loop.run_until_complete(backend.push_weights())  # builds the group; the first load of each path
        timed = []
        for _ in range(args.pushes):
            loop.run_until_complete(backend.push_weights())
            timed.append(backend.push_seconds)
        if backend.counts["weight_broadcast_fallbacks"]:
            raise SystemExit(f"{mode}: {backend.counts['weight_broadcast_fallbacks']} pushes fell back")
        check_engines(backend)
    finally:
        loop.run_until_complete(backend.close())
        loop.close()
    tensors = policy.model.state_dict().values()
    return PushRun(mode, repeat, args.engines, sum(p.numel() for p in policy.model.parameters()),
                   sum(t.numel() * t.element_size() for t in tensors) / 2**20, timed)


def check_engines(backend) -> None:
    expected = ray.get(backend.trainer.weights_ref())
    for engine in backend.engines:
        held = ray.get(engine.actor.__ray_call__.remote(lambda actor: actor.engine.engine.model.state_dict()))
        if not all(torch.equal(held[name], tensor) for name, tensor in expected.items()):
            raise SystemExit(f"{engine.name} does not hold rank 0's weights after the pushes")


def table(runs: list[PushRun]) -> str:
    lines = ["| weight_sync | engines | parameters | MB pushed | push s (median) | push s (min) | push s (max) |",
             "|---|---|---|---|---|---|---|"]
    for mode in MODES:
        pushes = [s for r in runs if r.weight_sync == mode for s in r.push_seconds]
        first = next(r for r in runs if r.weight_sync == mode)
        lines.append(f"| {mode} | {first.engines} | {first.parameters / 1e6:.1f}M | {first.megabytes:.0f} | "
                     f"{statistics.median(pushes):.3f} | {min(pushes):.3f} | {max(pushes):.3f} |")
    return "\n".join(lines)


def plot(runs: list[PushRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 3.5))
    axes.boxplot([[s for r in runs if r.weight_sync == mode for s in r.push_seconds] for mode in MODES])
    axes.set_xticks(range(1, len(MODES) + 1), MODES)
    axes.set_ylabel("push seconds")
    axes.set_title(f"weight push, {runs[0].engines} engines, {runs[0].megabytes:.0f} MB")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-out/weight_sync"))
    args = parser.parse_args(argv)
    machine = Machine.measure()
    print(machine.describe())
    machine.warn_if_busy()
    settings = ray_settings(load_config(None, ["backend.kind=ray", f"backend.num_engines={args.engines}"]))
    stop_ray = start_ray(settings)
    try:
        runs = [time_pushes(mode, repeat, args) for repeat in range(args.repeats) for mode in MODES]
    finally:
        stop_ray()
    markdown = table(runs)
    print(markdown)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(markdown + "\n")
    (args.out / "results.json").write_text(json.dumps({"machine": machine.as_dict(), "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "runs": [{**asdict(r), "median_seconds": r.median_seconds} for r in runs]}, indent=2))
    plot(runs, args.out / "weight_sync.png")
    print(f"wrote {args.out}/table.md, results.json, weight_sync.png")


if __name__ == "__main__":
    main()
