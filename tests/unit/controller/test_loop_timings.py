"""A step's time split in the loop's metrics: generation (the engine's own step time since the last push),
waiting for verdicts, the weight push."""

import asyncio
import time

import pytest
from scripted_backend import FinishedQueue

from flashreinforce.buffer import build_scheduler
from flashreinforce.controller.loop import LoopSettings, RLLoop
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.models import build_char_tokenizer
from flashreinforce.types import Generation, Prompt, SamplingParams, Verdict

VERDICT_SECONDS, PUSH_SECONDS = 0.05, 0.03


class TimedBackend(FinishedQueue):
    """Each request finishes at once and adds 0.25 s to the engine's step-time counter; verdicts and pushes
    take known times."""

    def __init__(self) -> None:
        super().__init__()
        self.engine_seconds = 0.0

    free_slots = 8

    @property
    def in_flight(self) -> int:
        return len(self.done)

    def submit(self, rid, prompt_ids, params, prefix=None):
        self.engine_seconds += 0.25
        self.finish(Generation(rid, tuple(prompt_ids), (5,), (-0.5,), (0,), (1,), "stop", params))

    async def score(self, items):
        await asyncio.sleep(VERDICT_SECONDS)
        return [Verdict(1.0, True) for _ in items]

    async def train(self, batch):
        return {}

    async def pause(self):
        done, self.done = self.done, []
        return [], done

    async def push_weights(self):
        time.sleep(PUSH_SECONDS)  # noqa: ASYNC251 - a push that blocks the loop, as a real one does
        self.version = getattr(self, "version", 0) + 1
        return self.version

    async def resume(self, partials):
        pass

    async def abort(self, request_ids):
        return []

    def stats(self):
        return {"engine/step_seconds": self.engine_seconds}


@pytest.mark.parametrize("overlap", [True, False])
def test_each_step_reports_its_generation_verification_and_push_time(overlap):
    prompts = [Prompt(f"p{i}", "1+1=", "2") for i in range(8)]
    scheduler = build_scheduler("sync", prompt_at=prompts.__getitem__, batch_groups=2, group_size=1)
    steps: list[dict] = []
    loop = RLLoop(TimedBackend(), scheduler, TextEpisodes(build_char_tokenizer("0123456789+=")),
                  LoopSettings(total_steps=2, sampling=SamplingParams(max_new_tokens=4), seed=0, checkpoint_every=0,
                               eval_every=0, overlap=overlap, in_flight_updates=False),
                  on_step=lambda version, metrics, batch: steps.append(metrics), on_checkpoint=lambda v, s: None)
    asyncio.run(loop.run())

    assert len(steps) == 2
    for metrics in steps:
        assert metrics["time/generation_seconds"] == pytest.approx(0.5)  # two requests a step, 0.25 s each
        assert metrics["time/verify_seconds"] >= VERDICT_SECONDS
        assert metrics["time/push_seconds"] >= PUSH_SECONDS
        assert metrics["time/step_seconds"] >= metrics["time/verify_seconds"] + metrics["time/push_seconds"]
