"""The Backend protocol: everything the RL loop asks of the machinery that generates, scores and trains.

The loop (controller/loop.py) is written once against this; `local.py` implements it in one process and a
Ray backend implements the same methods with actors. Request ids are strings the loop chooses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from flashreinforce.types import Generation, Prompt, SamplingParams, Trajectory, Verdict


class Backend(Protocol):
    @property
    def free_slots(self) -> int:
        """Requests the engine can start now without queueing."""
        ...

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet handed back."""
        ...

    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
               prefix: Generation | None = None) -> None:
        """Start generating (or continue `prefix`, a partial generation of the same request)."""
        ...

    async def finished(self) -> list[Generation]:
        """Wait until at least one request finished; return every finished one (never aborted ones)."""
        ...

    async def score(self, items: Sequence[tuple[str, Prompt]]) -> list[Verdict]:
        """Verify (completion text, prompt) pairs; failures of user code come back as Verdicts."""
        ...

    async def train(self, batch: Sequence[Trajectory]) -> dict[str, float]:
        """One optimizer step on the batch; returns metrics. The engine keeps the old weights."""
        ...

    async def pause(self) -> tuple[list[Generation], list[Generation]]:
        """Stop decoding: (partials of everything in flight, finished ones not yet handed back).
        Paused requests are held (not in flight) until resumed or aborted."""
        ...

    async def push_weights(self) -> int:
        """Load the trainer's weights into the engine, paused or between two decoding steps (running
        requests then go on with their KV cache); returns their version."""
        ...

    async def resume(self, partials: Sequence[Generation]) -> None:
        """Continue paused requests under the current weights, keeping their prefixes exactly."""
        ...

    async def abort(self, request_ids: Sequence[str]) -> list[Generation]:
        """Cancel running or paused requests; returns their partial generations."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Trainer state (optimizer, schedule, version) for checkpoints."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...

    def save_model(self, directory: Any) -> None:
        """Write the trainer's model and tokenizer in Hugging Face format."""
        ...

    def stats(self) -> dict[str, float]:
        """Engine and verifier-pool counters (tokens, slot utilization, verifier outcomes)."""
        ...

    async def close(self) -> None:
        ...
