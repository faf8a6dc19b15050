"""A latency-only environment for the schedulers benchmark's agent workload (`--workload agent`).

It stands for a tool an agent calls: it does no work and judges nothing (reward 0; the verifier scores the
final turn), it only takes time. Each step sleeps a long-tailed latency that is a pure function of (prompt
id, seed, step index), so the same rollout waits the same time under every scheduler and after a replay.
The default mix: 85% of steps are fast, uniform in 5-15 ms (a cached lookup), 15% slow, uniform in
0.5-1.5 s (a search, a build, a remote call); the mean is ~0.16 s, the slow ones ~100x the fast. A sleep
uses no CPU, so many environment workers can wait at once on a 2-core machine.

The episode ends (`done`) after `steps` steps. Each step's observation is `observation`, text made of the
arithmetic tokenizer's characters (its ALPHABET) so it tokenizes as forced tokens without unknowns.

    env.kind=benchmarks/latency_env.py:LatencyEnv
    env.options={slow_fraction: 0.15, slow_seconds: [0.5, 1.5], fast_seconds: [0.005, 0.015], steps: 2}
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

ARITHMETIC_CHARS = frozenset("0123456789+=;")
"""flashreinforce.data.arithmetic.ALPHABET's single characters (the think tags are tokens of their own).
Written out, not imported: the worker that loads this file needs nothing from the benchmark."""


def unit_draws(prompt_id: str, seed: int, step: int) -> tuple[float, float]:
    """Two independent uniforms in [0, 1) from a hash of (prompt id, seed, step): no random state to carry."""
    digest = hashlib.blake2b(f"{prompt_id}/{seed}/{step}".encode(), digest_size=16).digest()
    return (int.from_bytes(digest[:8], "big") / 2**64, int.from_bytes(digest[8:], "big") / 2**64)


def step_latency(prompt_id: str, seed: int, step: int, *, slow_fraction: float = 0.15,
                 slow_seconds: Sequence[float] = (0.5, 1.5), fast_seconds: Sequence[float] = (0.005, 0.015)) -> float:
    """Seconds step `step` (0-based) of episode (prompt_id, seed) takes: slow with probability slow_fraction.

    Example: over many episodes, a share slow_fraction of the steps lies in slow_seconds, the rest in
    fast_seconds; step_latency("p1", 7, 0) is the same number on every call.
    """
    which, where = unit_draws(prompt_id, seed, step)
    low, high = slow_seconds if which < slow_fraction else fast_seconds
    return low + where * (high - low)


class LatencyEnv:
    """reset -> ""; each step sleeps step_latency(...) and returns (observation, 0.0, done, {})."""

    def __init__(self, slow_fraction: float = 0.15, slow_seconds: Sequence[float] = (0.5, 1.5),
                 fast_seconds: Sequence[float] = (0.005, 0.015), steps: int = 2, observation: str = "") -> None:
        if not 0 <= slow_fraction <= 1:
            raise ValueError(f"slow_fraction={slow_fraction}: must be in [0, 1]")
        for name, (low, high) in (("slow_seconds", slow_seconds), ("fast_seconds", fast_seconds)):
            if not 0 <= low <= high:
                raise ValueError(f"{name}={[low, high]}: need 0 <= low <= high")
        if steps < 1:
            raise ValueError(f"steps={steps}: an episode needs at least one step")
        if unknown := sorted(set(observation) - ARITHMETIC_CHARS):
            raise ValueError(f"observation={observation!r}: {unknown} are not arithmetic tokenizer characters "
                             f"({''.join(sorted(ARITHMETIC_CHARS))})")
        self.latency = {"slow_fraction": slow_fraction, "slow_seconds": tuple(slow_seconds),
                        "fast_seconds": tuple(fast_seconds)}
        self.steps, self.observation = steps, observation
        self._episode: tuple[str, int] | None = None
        self._taken = 0

    def reset(self, prompt: Any, seed: int) -> str:
        self._episode, self._taken = (prompt.id, seed), 0
        return ""  # the first prompt is the task alone, as in the single-turn workload

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self._episode is None:
            raise RuntimeError("step() before reset()")
        time.sleep(step_latency(*self._episode, self._taken, **self.latency))
        self._taken += 1
        return self.observation, 0.0, self._taken >= self.steps, {}

    def close(self) -> None:
        self._episode = None
