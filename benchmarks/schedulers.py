"""sync vs april vs urb vs stream on one long-tailed workload: speed, slot use, policy lag and bias.

Workload: the arithmetic task with columns drawn from DIGIT_WEIGHTS (35% 1, 35% 2, 25% 3, 5% 16
columns; a think step is ~9 tokens), so the median completion is ~22 tokens and a 16-column one
~150-170 (~7x): every batch of 128 holds a few rollouts that run ~7x longer than the rest. The policy
is the library's tiny Qwen2-style model warm-started by SFT on that mix (`build_policy`); it emits
one step per column, so its lengths follow problem size (accuracy does not matter here). The warm
start is cached under OUT/warm-start/<hash of its settings>/ and reused by later runs.

Every kind runs from the same warm start, data order and seed, for the same number of optimizer
steps, through the real RLLoop + LocalBackend (overlapped: engine thread, trainer thread, or a trainer
process with --trainer process, verifier processes) with FlashREINFORCE, one rollout per prompt, B = batch groups, no evals, in-flight weight
updates (the default). The engine has B * (max_lag + 1) slots for every kind: U-RB's inference pool holds
B * N prompts, and an engine with only B slots would starve it; sync cannot use more than B.
Kind options are the library defaults (april over_provision 2, stream gate) except the lag bound, which
--max-lag sweeps: urb and stream run once per bound L (urb buffer_size N = L + 1, stream max_staleness
S = L; the library default is L = 1), sync and april once, their engine sized for the first bound. A row
is one (kind, lag bound). Measured per row, over the steps after the first --warmup:
- steps/s: optimizer steps / wall seconds between the end of step `warmup` and the end of the last;
- slot util: the engine's busy / available slot-steps (EngineStats) over that window; engine busy:
  its seconds inside step() / wall seconds (sync's engine idles while the learner trains); decode ms/step:
  those seconds per decoding step (higher beside a training step: the two share 2 cores); trainer busy:
  the trainer's seconds inside its steps / wall seconds. Whichever is near 100% bounds the overlapped kinds;
- lag: step - policy version of every trained sampled token, mean and max over the whole run;
- bias: KS statistic (two-sample, sup |F1 - F2|) of the trained difficulties and trained lengths
  (policy tokens) against sync's, and the mean trained difficulty of the first steps and of all steps
  against the data order's over the same positions (what sync and urb train by construction); and the
  share of trained prompts trained at another step than their data-order step (t != position // B), with
  the mean |delay| in steps: 0 for an order-preserving scheduler.
With --repeats R the rows run R times, interleaved; speed columns show the median run, bias and
lag pool all runs.

--workload agent: the same policy and data, each rollout an episode in latency_env.py's LatencyEnv (a tool
that only takes time): the think is one turn (it ends at </think>), then an env step, the answer a second
turn, then a step; 85% of steps take 5-15 ms, 15% 0.5-1.5 s (--slow-fraction, --slow-seconds), a pure
function of (prompt, seed, step), so every kind waits the same for the same rollout. Observations are empty,
so the rows are the single-turn ones and the bias columns compare as before; the verifier scores the final
turn. The episodes run through the library's EpisodeBackend and EnvPool, with one env worker per engine slot
(a worker runs one call at a time). One more column, env busy: the pool's summed call seconds / wall seconds
over the window, the mean number of env calls running at once (so it passes 100%). The goal: stream and urb
>= 2x sync steps/s.

    python benchmarks/schedulers.py                  # the default run (SFT once, then ~20 s per row)
    python benchmarks/schedulers.py --quick          # smoke run, under a minute with its warm start
    python benchmarks/schedulers.py --workload agent --steps 30   # multi-turn episodes with slow tool steps
    flashreinforce bench schedulers --repeats 3 --json bench-out/schedulers.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashreinforce.config import RunConfig, load_config
from flashreinforce.controller.loop import LoopSettings, RLLoop
from flashreinforce.data.arithmetic import THINK_CLOSE
from flashreinforce.data.order import PromptOrder
from flashreinforce.envs.pool import EnvPool
from flashreinforce.metrics.console import Reporter
from flashreinforce.rollout.engine import Engine
from flashreinforce.run.backends import (
    build_local_backend,
    build_env_pool,
    build_episode_backend,
    build_episodes,
    build_verifier_pool,
)
from flashreinforce.run.data import Data, load_data
from flashreinforce.run.engines import (
    EngineShape,
    build_engine,
    longest_rendered,
    rollout_params,
)
from flashreinforce.run.learner import start_trainer
from flashreinforce.run.policy import build_policy, seed_everything
from flashreinforce.run.scheduling import build_run_scheduler
from flashreinforce.types import SamplingParams, Trajectory

# `flashreinforce bench` runs this file with runpy, which does not put its directory on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import Machine

KINDS = ("sync", "april", "urb", "stream")
LAG_BOUNDED = ("urb", "stream")
"""The kinds whose lag bound is a knob (urb's N, stream's S): run once per --max-lag."""
OTHER_CORES_NOISY = 0.25
"""Other processes using more than this many cores on average during a run make its timings suspect."""
DIGIT_WEIGHTS = [0.35, 0.35, 0.25] + [0.0] * 12 + [0.05]
"""Share of problems with 1, 2, ..., 16 columns."""
WORKLOAD = [
    "data.arithmetic.digit_weights=" + json.dumps(DIGIT_WEIGHTS),
    "model.tiny.max_position_embeddings=224",  # longest prompt (34) + max_new_tokens
    "rollout.max_new_tokens=184",  # a 16-column completion is ~170 tokens
    "sft.steps=200",  # enough for lengths to follow the column count (measured), not for accuracy
    "scheduler.group_size=1",
    "algo.loss=flashreinforce",
]
QUICK = [  # a smaller model and tail: checks that everything runs, not the figures
    "data.arithmetic.digit_weights=" + json.dumps([0.35, 0.35, 0.25, 0, 0, 0, 0.05]),
    "data.arithmetic.num_train=2000",
    "model.tiny.hidden_size=64",
    "model.tiny.max_position_embeddings=112",
    "rollout.max_new_tokens=96",
    "sft.steps=60",
    "sft.batch_size=32",
    "verifier.max_workers=1",
]
LATENCY_ENV = Path(__file__).resolve().parent / "latency_env.py"
LATENCY_MIX = {"slow_fraction": 0.15, "slow_seconds": [0.5, 1.5], "fast_seconds": [0.005, 0.015]}
"""The agent workload's step latencies (latency_env.py): 85% of steps take 5-15 ms, 15% take 0.5-1.5 s."""
QUICK_SLOW_SECONDS = [0.1, 0.3]
"""--quick's slow steps: a shorter wait, the same code paths."""
AGENT_GOAL = 2.0
"""The agent workload's goal: stream and urb >= 2x sync steps/s (the arithmetic one: 1.5x)."""


def agent_overrides(turns: int, workers: int, mix: dict, observation: str = "") -> list[str]:
    """Each rollout an episode of `turns` model turns, each followed by one LatencyEnv step.

    A turn ends at </think> or EOS, so a 2-turn episode is the think, a step, the answer, a step. With the
    default empty observation the row is the single-turn workload's, so the policy, its lengths and the bias
    columns stay comparable and only the waiting is new (the SFT policy never saw text after </think>: a
    ";" there changes what it writes). The reward is the verifier's on the final turn (the answer).
    `workers` env processes start with the pool (min = max): a worker runs one call at a time and an
    episode's session stays on the worker it was reset on, so episodes sharing a worker wait behind each
    other's slow steps (384 sessions on 128 workers: 243 ms mean per step against the calls' own 144 ms).
    Sleeping uses no CPU, so every episode the engine can hold gets a worker of its own.
    """
    options = {**mix, "steps": turns, "observation": observation}
    return [f"env.kind={LATENCY_ENV}:LatencyEnv", "env.options=" + json.dumps(options), f"env.max_turns={turns}",
            "env.reward=verifier", 'env.observation_suffix=""', "env.step_timeout_s=30",
            f"env.min_workers={workers}", f"env.max_workers={workers}"]


@dataclass(frozen=True)
class Step:
    """What one optimizer step trained, and the clocks and engine counters right after its weight push."""

    seconds: float
    """Since the loop started."""
    busy_slot_steps: int
    available_slot_steps: int
    engine_seconds: float
    engine_steps: int
    """The engine's decoding steps so far."""
    train_seconds: float
    """The trainer's own time for this step (forward, backward, optimizer)."""
    difficulties: list[float]
    lengths: list[int]
    """Policy (sampled) tokens of each trained trajectory."""
    positions: list[int]
    """Data-order positions of the trained prompts."""
    lag_sum: int
    lag_tokens: int
    lag_max: int
    env_seconds: float | None = None
    """The env pool's summed call time so far (EnvPool.busy_seconds); None without environments."""
    reward: float | None = None
    """The batch's mean reward (the verifier's): a workload that breaks the policy shows here."""


@dataclass
class KindRun:
    kind: str
    max_lag: int
    """The --max-lag bound whose config the run used (sync and april: the first, which sizes their engine)."""
    steps: list[Step] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)
    env: dict[str, float] = field(default_factory=dict)
    """The env pool's stats() at the end (workers, calls, workers_started, ...); empty without environments."""
    episode_ends: dict[str, int] = field(default_factory=dict)
    """How episodes ended (EpisodeBackend.counts: end/done, end/length, ...); empty without environments."""
    setup_seconds: float = 0.0
    other_cores: float = 0.0
    """Cores other processes kept busy on average during the run: the noise in its timings."""


@dataclass(frozen=True)
class CpuClock:
    """Busy CPU seconds of the whole machine (/proc/stat) and of this process with its reaped children.

    The difference between two readings, machine minus ours, is what other processes used meanwhile: a
    direct measure of how disturbed a run was, where the load average also counts our own threads.
    """

    wall: float
    machine: float
    ours: float

    @classmethod
    def read(cls) -> CpuClock:
        with open("/proc/stat") as f:
            jiffies = [int(x) for x in f.readline().split()[1:]]
        idle = jiffies[3] + jiffies[4]  # idle + iowait
        own = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)  # verifier workers, once the pool reaped them
        return cls(
            wall=time.perf_counter(),
            machine=(sum(jiffies[:8]) - idle) / os.sysconf("SC_CLK_TCK"),  # guest time is inside user time
            ours=own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime,
        )

    def other_cores_since(self, start: CpuClock) -> float:
        return max(0.0, (self.machine - start.machine) - (self.ours - start.ours)) / (self.wall - start.wall)


def bench_config(quick: bool, batch: int, steps: int, max_lag: int, trainer: str = "thread",
                 workload: Sequence[str] = ()) -> RunConfig:
    """The run config every kind shares; max_lag bounds urb (N = max_lag + 1) and stream (S = max_lag) alike.
    `workload`: more overrides (the agent workload's env.*)."""
    overrides = [*WORKLOAD, *(QUICK if quick else ()), f"scheduler.batch_groups={batch}",
                 f"rollout.max_batch_size={batch * (max_lag + 1)}", f"trainer.steps={steps}",
                 f"scheduler.buffer_size={max_lag + 1}", f"scheduler.max_staleness={max_lag}",
                 f"backend.trainer_process={trainer == 'process'}", *workload]
    return load_config("arithmetic", overrides)


def warm_start_dir(config: RunConfig, out: Path) -> Path:
    """OUT/warm-start/<key>: the key hashes every setting the warm start depends on."""
    settings = {k: config.model_dump(mode="json")[k] for k in ("seed", "model", "data", "sft")}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return out / "warm-start" / key


def batch_record(version: int, metrics: dict[str, float], batch: Sequence[Trajectory], started: float,
                 engine: Engine, env_pool: EnvPool | None = None) -> Step:
    step = version - 1  # on_step runs after the push; the batch was trained at the previous version
    lags = [step - v for t in batch for v, m in zip(t.policy_versions, t.loss_mask) if m]
    stats = engine.stats  # an immutable snapshot, safe to read while the engine thread runs
    return Step(
        seconds=time.perf_counter() - started,
        busy_slot_steps=stats.busy_slot_steps,
        available_slot_steps=stats.available_slot_steps,
        engine_seconds=stats.step_seconds,
        engine_steps=stats.steps,
        train_seconds=metrics["time/train_seconds"],
        difficulties=[t.prompt.difficulty for t in batch],
        lengths=[t.num_policy_tokens for t in batch],
        positions=[t.group for t in batch],
        lag_sum=sum(lags),
        lag_tokens=len(lags),
        lag_max=max(lags, default=0),
        env_seconds=env_pool.busy_seconds if env_pool is not None else None,
        reward=metrics.get("reward/mean"),
    )


def variants(kinds: Sequence[str], lags: Sequence[int]) -> list[tuple[str, str, int]]:
    """(row name, kind, lag bound) per row: the lag-bounded kinds at every bound, the others at the first.

    Example: variants(["sync", "urb"], [1, 2]) == [("sync", "sync", 1), ("urb lag<=1", "urb", 1),
    ("urb lag<=2", "urb", 2)].
    """
    return [(f"{kind} lag<={lag}" if kind in LAG_BOUNDED else kind, kind, lag)
            for kind in kinds for lag in (lags if kind in LAG_BOUNDED else lags[:1])]


def sampling_params(config: RunConfig, tokenizer: Any) -> SamplingParams:
    """rollout_params; with environments a turn also ends at </think> (agent_overrides). As a stop token, not
    env.stop_strings: a stop string is checked by decoding every running row's turn at every decoding step,
    ~10 us a row here, as much again as the rest of a step at a few hundred rows."""
    params = rollout_params(config)
    if not config.env.multi_turn:
        return params
    (close,) = tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
    return replace(params, stop_token_ids=(*params.stop_token_ids, close))


async def run_kind(kind: str, config: RunConfig, data: Data, warm_dir: Path) -> KindRun:
    """One RL run of `kind` from the cached warm start; returns what every step trained, and when."""
    setup_started = time.perf_counter()
    seed_everything(config.seed)
    # The run layer's builders, as `flashreinforce train` uses them, minus checkpoints and evaluation.
    policy = build_policy(config, data, warm_dir, Reporter(enabled=False))
    episodes = build_episodes(config, policy.tokenizer)
    trainer = start_trainer(config, policy)
    # No env.max_prompt_tokens reserve: LatencyEnv's reset observation is empty, the first prompt is the task.
    shape = EngineShape(longest_rendered(episodes, data.train), config.rollout.max_new_tokens, version=0,
                        seed=config.seed)
    engine = build_engine(config, policy, shape)
    scheduler = build_run_scheduler(config, data, kind=kind)
    pool = build_verifier_pool(config)
    pool.score_sync("", data.train[0])  # the worker's start-up (imports) is not the scheduler's cost
    backend = build_local_backend(config, engine, trainer, pool, policy.tokenizer)
    env_pool = build_env_pool(config)  # None for the single-turn arithmetic workload
    if env_pool is not None:
        backend = build_episode_backend(config, backend, episodes, env_pool, shape.context)
    settings = LoopSettings(total_steps=config.trainer.steps, sampling=sampling_params(config, policy.tokenizer),
                            seed=config.seed, checkpoint_every=0, eval_every=0, overlap=True)
    result = KindRun(kind, max_lag=config.scheduler.max_staleness)
    try:
        if env_pool is not None:
            await env_pool.start()  # its min_workers processes start before the clock does
        started = time.perf_counter()
        loop = RLLoop(backend, scheduler, episodes, settings,
                      on_step=lambda version, metrics, batch: result.steps.append(
                          batch_record(version, metrics, batch, started, engine, env_pool)),
                      on_checkpoint=lambda version, state: None)
        result.setup_seconds = started - setup_started
        await loop.run()
    finally:
        await backend.close()
        if env_pool is not None:
            result.env, result.episode_ends = env_pool.stats(), dict(backend.counts)
            await env_pool.aclose()
        pool.close()
        trainer.close()
    result.dropped = {k: v for k, v in scheduler.ledger.summary().items() if k.startswith("dropped/")}
    return result


def ks_statistic(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sample Kolmogorov-Smirnov statistic D = sup_x |F_a(x) - F_b(x)| of the empirical CDFs.

    Evaluating both CDFs (right-continuous) at every observed value finds the sup, ties included.
    Example: a = [1, 2], b = [2, 3]: F_a - F_b at 1, 2, 3 is 1/2 - 0, 1 - 1/2, 1 - 1, so D = 1/2.
    """
    a, b = np.sort(np.asarray(a, dtype=float)), np.sort(np.asarray(b, dtype=float))
    assert len(a) and len(b), f"KS needs two non-empty samples, got {len(a)} and {len(b)}"
    grid = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, grid, side="right") / len(a)
    cdf_b = np.searchsorted(b, grid, side="right") / len(b)
    return float(np.max(np.abs(cdf_a - cdf_b)))


def speed(run: KindRun, warmup: int) -> dict[str, float]:
    """steps/s, slot utilization, the engine's, trainer's and env pool's busy fractions after step `warmup`."""
    first, last = run.steps[warmup - 1] if warmup else None, run.steps[-1]
    t0, busy0, avail0, engine0, decode0 = (first.seconds, first.busy_slot_steps, first.available_slot_steps,
                                           first.engine_seconds, first.engine_steps) if first else (0.0, 0, 0, 0.0, 0)
    wall = last.seconds - t0
    # Env calls overlap, so env busy can pass 100%: it is the mean number of environment calls running at once.
    env_busy = None if last.env_seconds is None else (last.env_seconds - (first.env_seconds if first else 0.0)) / wall
    return {
        "steps_per_second": (len(run.steps) - warmup) / wall,
        "slot_utilization": (last.busy_slot_steps - busy0) / max(last.available_slot_steps - avail0, 1),
        "engine_busy": (last.engine_seconds - engine0) / wall,
        "decode_ms": 1000 * (last.engine_seconds - engine0) / max(last.engine_steps - decode0, 1),
        "trainer_busy": sum(s.train_seconds for s in run.steps[warmup:]) / wall,
        "env_busy": env_busy,
        "measured_seconds": wall,
    }


def summarize(runs: dict[str, list[KindRun]], data_difficulty: list[float], warmup: int, first_steps: int,
              batch: int) -> dict:
    """Per row: speed of its median run; lag and bias pooled over its runs."""
    pooled = {name: [s for run in kind_runs for s in run.steps] for name, kind_runs in runs.items()}
    sync_difficulty = [d for s in pooled.get("sync", []) for d in s.difficulties]
    sync_length = [n for s in pooled.get("sync", []) for n in s.lengths]
    data_early = data_difficulty[:first_steps * batch]
    rows = {}
    for name, kind_runs in runs.items():
        speeds = sorted((speed(run, warmup) for run in kind_runs), key=lambda r: r["steps_per_second"])
        steps = pooled[name]
        difficulty = [d for s in steps for d in s.difficulties]
        length = [n for s in steps for n in s.lengths]
        early = [d for run in kind_runs for s in run.steps[:first_steps] for d in s.difficulties]
        delays = [t - p // batch for run in kind_runs for t, s in enumerate(run.steps) for p in s.positions]
        rows[name] = {
            "kind": kind_runs[0].kind,
            "max_lag": kind_runs[0].max_lag,
            **speeds[len(speeds) // 2],
            "steps_per_second_runs": [r["steps_per_second"] for r in speeds],
            "other_cores_runs": [run.other_cores for run in kind_runs],
            "lag_mean": sum(s.lag_sum for s in steps) / max(sum(s.lag_tokens for s in steps), 1),
            "lag_max": max(s.lag_max for s in steps),
            "ks_difficulty_vs_sync": ks_statistic(difficulty, sync_difficulty) if sync_difficulty else None,
            "ks_length_vs_sync": ks_statistic(length, sync_length) if sync_length else None,
            "ks_difficulty_vs_data": ks_statistic(difficulty, data_difficulty),
            "ks_difficulty_first_steps_vs_data": ks_statistic(early, data_early),
            "mean_difficulty": float(np.mean(difficulty)),
            "mean_difficulty_first_steps": float(np.mean(early)),
            "data_first_mean": float(np.mean(data_early)),
            "off_step_fraction": float(np.mean([d != 0 for d in delays])),
            "mean_abs_delay": float(np.mean(np.abs(delays))),
            "mean_length": float(np.mean(length)),
            "dropped": kind_runs[0].dropped,
            "env_pool": kind_runs[0].env,
            "episode_ends": kind_runs[0].episode_ends,
            "reward_mean": float(np.mean([s.reward for s in steps])) if steps[0].reward is not None else None,
            "setup_seconds": statistics.median(run.setup_seconds for run in kind_runs),
            "runs": [[asdict(s) for s in run.steps] for run in kind_runs],
        }
    if "sync" in rows:
        for row in rows.values():
            row["speedup_vs_sync"] = row["steps_per_second"] / rows["sync"]["steps_per_second"]
    return rows


def ks_critical(n: int, m: int, alpha: float = 0.05) -> float:
    """Asymptotic two-sample KS critical value: D above it is unlikely (p < alpha) for samples of one law."""
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


def print_table(rows: dict, data_mean: float, data_first_mean: float, first_steps: int) -> None:
    """The rows as a markdown table; the env busy column only when the workload has environments."""
    env = any(r["env_busy"] is not None for r in rows.values())
    print(f"| kind | steps/s | vs sync | slot util | engine busy | decode ms/step | trainer busy "
          f"{'| env busy ' if env else ''}| lag mean / max "
          f"| trained off their data step (mean delay) | KS difficulty | KS length "
          f"| mean difficulty (data {data_mean:.2f}) | first {first_steps} steps: mean difficulty "
          f"(data {data_first_mean:.2f}), KS vs data |")
    print("|---" * (14 if env else 13) + "|")
    for r in rows.values():
        runs = r["steps_per_second_runs"]
        spread = f" ({min(runs):.2f}-{max(runs):.2f})" if len(runs) > 1 else ""
        vs = f"{r['speedup_vs_sync']:.2f}x" if "speedup_vs_sync" in r else "-"
        ks = [f"{r[k]:.3f}" if r[k] is not None else "-" for k in ("ks_difficulty_vs_sync", "ks_length_vs_sync")]
        label = f"`{r['kind']}`" + (f" lag ≤ {r['max_lag']}" if r["kind"] in LAG_BOUNDED else "")
        env_busy = f"| {r['env_busy']:.0%} " if env else ""
        print(f"| {label} | {r['steps_per_second']:.3f}{spread} | {vs} | {r['slot_utilization']:.0%} "
              f"| {r['engine_busy']:.0%} | {r['decode_ms']:.2f} | {r['trainer_busy']:.0%} {env_busy}"
              f"| {r['lag_mean']:.2f} / {r['lag_max']} "
              f"| {r['off_step_fraction']:.1%} ({r['mean_abs_delay']:.2f} steps) | {ks[0]} | {ks[1]} "
              f"| {r['mean_difficulty']:.2f} | {r['mean_difficulty_first_steps']:.2f}, "
              f"{r['ks_difficulty_first_steps_vs_data']:.3f} |")


def check_goals(rows: dict, early_critical: float, speedup_goal: float = 1.5) -> list[str]:
    """The issue's goals, each as 'met' / 'NOT met' with the figure."""
    lines = []
    for r in rows.values():
        if r["kind"] in LAG_BOUNDED and "speedup_vs_sync" in r:
            x = r["speedup_vs_sync"]
            lines.append(f"goal {r['kind']} >= {speedup_goal:g}x sync steps/s, lag <= {r['max_lag']}: {x:.2f}x, "
                         f"{'met' if x >= speedup_goal else 'NOT met'}")
    for r in rows.values():
        if r["kind"] == "urb" and r["ks_difficulty_vs_sync"] is not None:
            ks = max(r["ks_difficulty_vs_sync"], r["ks_length_vs_sync"])
            lines.append(f"goal urb as unbiased as sync (KS <= 0.05), lag <= {r['max_lag']}: largest KS {ks:.3f}, "
                         f"{'met' if ks <= 0.05 else 'NOT met'}")
    if "april" in rows:
        r = rows["april"]
        # The data order is what an unbiased scheduler trains at each step; april trains whatever finished first,
        # which pulls easy prompts forward. KS over four difficulty values (5% of them long) has little power, so
        # visibility is read off the order itself and the early difficulty; the KS is reported beside them.
        visible = r["off_step_fraction"] > 0 and r["mean_difficulty_first_steps"] < r["data_first_mean"]
        lines.append(f"goal april's bias visible: {r['off_step_fraction']:.1%} of its prompts trained off their data "
                     f"step, first steps' mean difficulty {r['mean_difficulty_first_steps']:.2f} vs the data's "
                     f"{r['data_first_mean']:.2f} (KS {r['ks_difficulty_first_steps_vs_data']:.3f}, 5% critical value "
                     f"{early_critical:.3f}), {'met' if visible else 'NOT met'}")
    return lines


def plot(rows: dict, data_difficulty: list[float], batch: int, path: Path) -> None:
    """Three panels: steps/s; running mean of trained difficulty against the data order's; CDF of trained lengths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (bars, drift, cdf) = plt.subplots(1, 3, figsize=(15, 4))
    names = list(rows)
    bars.bar(names, [rows[k]["steps_per_second"] for k in names], color=[f"C{i}" for i in range(len(names))])
    bars.tick_params(axis="x", labelrotation=30)
    bars.set_title("optimizer steps / s (median run)")
    for i, name in enumerate(names):
        steps = rows[name]["runs"][0]
        trained = np.cumsum([sum(s["difficulties"]) for s in steps]) / np.cumsum([len(s["difficulties"]) for s in steps])
        drift.plot(range(1, len(steps) + 1), trained, color=f"C{i}", label=name)
        lengths = np.sort([n for run in rows[name]["runs"] for s in run for n in s["lengths"]])
        cdf.step(lengths, np.arange(1, len(lengths) + 1) / len(lengths), where="post", color=f"C{i}", label=name)
    steps = len(rows[names[0]]["runs"][0])
    data = np.cumsum(data_difficulty[:steps * batch])[batch - 1::batch] / np.arange(batch, steps * batch + 1, batch)
    drift.plot(range(1, steps + 1), data, color="k", linestyle=":", label="data order")
    drift.set_title("mean difficulty (columns) trained up to each step")
    drift.set_xlabel("optimizer step")
    drift.legend()
    cdf.set_title("CDF of trained lengths (policy tokens)")
    cdf.set_xlabel("tokens")
    cdf.legend()
    for axis in (bars, drift, cdf):
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("arithmetic", "agent"), default="arithmetic",
                        help="arithmetic: single-turn rollouts; agent: each rollout an episode whose environment "
                             "steps have long-tailed latency (latency_env.py)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default 40; --quick 6)")
    parser.add_argument("--batch", type=int, help="prompts per step, B (default 128; --quick 32); engine slots B * (max lag + 1)")
    parser.add_argument("--warmup", type=int, help="first steps left out of the speed figures (default 3; --quick 1)")
    parser.add_argument("--first-steps", type=int, default=5, help="how many first steps the early bias column spans")
    parser.add_argument("--max-lag", type=int, nargs="+", default=[1, 2],
                        help="lag bounds to run urb (N = L + 1) and stream (S = L) at (default 1 2; the library's "
                             "default is 1); sync and april run once, with the engine of the first")
    parser.add_argument("--trainer", choices=("thread", "process"), default="thread",
                        help="where the optimizer step runs: a thread beside the engine (the library default) or its "
                             "own process (backend.trainer_process)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per row, interleaved (speed: median run)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of " + ",".join(KINDS))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "bench-out",
                        help="folder of the warm-start cache and the PNG (default bench-out/)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--quick", action="store_true", help="tiny model, short tail, few steps: a smoke run")
    agent = parser.add_argument_group("agent workload")
    agent.add_argument("--turns", type=int, default=2, help="model turns per episode, an env step after each "
                       "(default 2: the think, then the answer)")
    agent.add_argument("--slow-fraction", type=float, default=LATENCY_MIX["slow_fraction"],
                       help="share of env steps that are slow (default 0.15; the rest take 5-15 ms)")
    agent.add_argument("--slow-seconds", type=float, nargs=2, metavar=("LOW", "HIGH"),
                       help=f"a slow step's latency range (default {LATENCY_MIX['slow_seconds']}; --quick "
                            f"{QUICK_SLOW_SECONDS})")
    agent.add_argument("--observation", default="", help="each env step's observation, forced tokens made of "
                       "0-9 + = ; (default empty: the rows stay the single-turn ones)")
    agent.add_argument("--env-workers", type=int, help="env worker processes, each running one call at a time "
                       "(default: the engine's slots, B * (max lag + 1), one per episode in flight)")
    args = parser.parse_args()
    args.steps = args.steps or (6 if args.quick else 40)
    args.batch = args.batch or (32 if args.quick else 128)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.kinds = [k.strip() for k in args.kinds.split(",")]
    if unknown := sorted(set(args.kinds) - set(KINDS)):
        raise ValueError(f"--kinds: unknown {unknown}; choose from {','.join(KINDS)}")
    if min(args.max_lag) < 1:
        raise ValueError(f"--max-lag {args.max_lag}: use 1 or more (0 would make urb and stream synchronous)")
    if not 0 <= args.warmup < args.steps:
        raise ValueError(f"--warmup {args.warmup} must leave steps to measure out of --steps {args.steps}")
    return args


def workload_overrides(args: argparse.Namespace, max_lag: int) -> list[str]:
    if args.workload == "arithmetic":
        return []
    slow = args.slow_seconds or (QUICK_SLOW_SECONDS if args.quick else LATENCY_MIX["slow_seconds"])
    mix = {**LATENCY_MIX, "slow_fraction": args.slow_fraction, "slow_seconds": list(slow)}
    return agent_overrides(args.turns, args.env_workers or args.batch * (max_lag + 1), mix, args.observation)


def run_rows(args: argparse.Namespace, configs: dict[int, RunConfig], data: Data,
             warm_dir: Path) -> dict[str, list[KindRun]]:
    """Every row --repeats times, interleaved, each on a quiet-checked clock."""
    rows_to_run = variants(args.kinds, args.max_lag)
    runs: dict[str, list[KindRun]] = {name: [] for name, _, _ in rows_to_run}
    for repeat in range(args.repeats):
        for name, kind, lag in rows_to_run:
            clock = CpuClock.read()
            try:
                run = asyncio.run(run_kind(kind, configs[lag], data, warm_dir))
            except Exception as error:  # noqa: BLE001 - one broken row must not cost a long run's other rows
                print(f"  {name} (run {repeat + 1}/{args.repeats}): FAILED: {type(error).__name__}: {error}", flush=True)
                continue
            run.other_cores = CpuClock.read().other_cores_since(clock)
            runs[name].append(run)
            # A pool that grew to its most workers may have made episodes wait for one: say so.
            # Workers lost: env calls cancelled by an abort kill their worker (it cannot be interrupted).
            env = (f"; env pool {configs[lag].env.max_workers} workers ({run.env.get('workers_lost', 0):.0f} lost, "
                   f"{run.env.get('replays', 0):.0f} replays), {run.env['calls']:.0f} calls; episodes "
                   f"{run.episode_ends}, reward mean {np.mean([s.reward for s in run.steps]):.2f}" if run.env else "")
            print(f"  {name} (run {repeat + 1}/{args.repeats}): {args.steps} steps in {run.steps[-1].seconds:.1f} s "
                  f"(setup {run.setup_seconds:.0f} s), other processes used {run.other_cores:.2f} cores{env}", flush=True)
    return {name: kind_runs for name, kind_runs in runs.items() if kind_runs}  # failed rows are left out


def main() -> None:
    args = parse_args()
    configs = {lag: bench_config(args.quick, args.batch, args.steps, lag, args.trainer, workload_overrides(args, lag))
               for lag in args.max_lag}
    config = configs[args.max_lag[0]]  # model, data and warm start do not depend on the lag bound
    torch.set_num_threads(config.backend.torch_threads)  # one per thread (engine, trainer): 2 cores
    machine = Machine.measure()
    print(machine.describe())
    machine.warn_if_busy()
    started = time.perf_counter()

    data = load_data(config)
    warm_dir = warm_start_dir(config, args.out)  # the workload's env settings are not in its key: shared
    reused = (warm_dir / "sft" / "config.json").is_file()
    warm_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(config.seed)
    build_policy(config, data, warm_dir, Reporter(enabled=True))
    print(f"warm start: {'reused' if reused else 'trained and cached'} {warm_dir / 'sft'} "
          f"({time.perf_counter() - started:.0f} s)")

    runs = run_rows(args, configs, data, warm_dir)
    if not runs:
        raise SystemExit("every row failed: nothing to report")
    order = PromptOrder(data.train, seed=config.data.shuffle_seed)
    data_difficulty = [order[i].difficulty for i in range(args.steps * args.batch)]
    early = args.first_steps * args.batch
    rows = summarize(runs, data_difficulty, args.warmup, args.first_steps, args.batch)
    lengths = [n for s in next(iter(runs.values()))[0].steps for n in s.lengths]
    print(f"\n{args.workload} workload: {len(runs)} rows x {args.repeats} run(s), {args.steps} steps of B={args.batch} "
          f"(speed after {args.warmup} warm-up steps); trained lengths median {np.median(lengths):.0f}, max "
          f"{max(lengths)} policy tokens")
    print_table(rows, float(np.mean(data_difficulty)), float(np.mean(data_difficulty[:early])), args.first_steps)
    print(machine.describe())
    machine.warn_if_busy()
    other = max(run.other_cores for kind_runs in runs.values() for run in kind_runs)
    if other > OTHER_CORES_NOISY:
        print(f"WARNING: other processes kept up to {other:.2f} cores busy during a run (this one needs 2): "
              "the speed figures are disturbed; rerun on an idle machine before quoting them")
    goals = check_goals(rows, ks_critical(early, early), AGENT_GOAL if args.workload == "agent" else 1.5)
    print("\n".join(goals))

    png = args.out / ("schedulers.png" if args.workload == "arithmetic" else f"schedulers_{args.workload}.png")
    plot(rows, data_difficulty, args.batch, png)
    wall = time.perf_counter() - started
    print(f"plot: {png}; wall {wall:.0f} s")
    if args.json:
        report = {
            "machine": machine.as_dict(),
            "other_cores_max": other,
            "settings": {**{name: value for name, value in vars(args).items() if name not in ("out", "json")},
                         "config": config.model_dump(mode="json"),
                         "config_by_lag": {lag: c.model_dump(mode="json") for lag, c in configs.items()}},
            "warm_start": {"dir": str(warm_dir / "sft"), "reused": reused},
            "data": {"difficulties": data_difficulty},
            "kinds": rows,
            "goals": goals,
            "png": str(png),
            "wall_seconds": wall,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
