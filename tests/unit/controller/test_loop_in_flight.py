"""RLLoop with in-flight weight updates, against a scripted backend: pushes without pausing, and the race
where the scheduler cancels a rollout that the engine finished a moment before the abort reached it."""

import asyncio
import dataclasses

from scripted_backend import FinishedQueue

from flashreinforce.buffer import build_scheduler
from flashreinforce.controller.loop import LoopSettings, RLLoop, request_id
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.models import build_char_tokenizer
from flashreinforce.types import Generation, Prompt, SamplingParams, Verdict


class ScriptedBackend(FinishedQueue):
    """Every request finishes at once, except the `slow` ones, which never finish by themselves: aborting
    one returns nothing and hands it back through finished() instead, as if it had just finished."""

    def __init__(self, slow: set[str]) -> None:
        super().__init__()
        self.slow = slow
        self.running: dict[str, Generation] = {}
        self.version = 0
        self.calls: list[str] = []

    @property
    def free_slots(self) -> int:
        return 8 - len(self.running)

    @property
    def in_flight(self) -> int:
        return len(self.running) + len(self.done)

    def submit(self, rid, prompt_ids, params, prefix=None):
        generation = Generation(rid, tuple(prompt_ids), (5,), (-0.5,), (self.version,), (1,), "stop", params)
        if rid in self.slow:
            self.running[rid] = generation
        else:
            self.finish(generation)

    async def score(self, items):
        return [Verdict(1.0, True) for _ in items]

    async def train(self, batch):
        await asyncio.sleep(0)
        return {"trained": float(len(batch))}

    async def pause(self):
        self.calls.append("pause")
        partials = [dataclasses.replace(g, finish_reason="abort") for g in self.running.values()]
        self.running.clear()
        done, self.done = self.done, []
        return partials, done

    async def push_weights(self):
        self.version += 1
        self.calls.append(f"push {self.version}")
        return self.version

    async def resume(self, partials):
        self.calls.append("resume")

    async def abort(self, request_ids):
        self.calls.append(f"abort {sorted(request_ids)}")
        for rid in request_ids:  # each one finished just before the abort: nothing to return
            if rid in self.running:
                self.finish(self.running.pop(rid))
        return []

    def stats(self):
        return {}


def test_a_cancelled_rollout_that_finished_first_goes_back_as_aborted_not_trained():
    prompts = [Prompt(f"p{i}", "1+1=", "2") for i in range(20)]
    scheduler = build_scheduler("stream", prompt_at=prompts.__getitem__, batch_groups=1, group_size=1,
                                max_staleness=1, stale_policy="drop")
    backend = ScriptedBackend(slow={"p1#0"})  # the second prompt's first attempt never finishes by itself
    tokenizer = build_char_tokenizer("0123456789+=")
    trained: list[list[str]] = []
    loop = RLLoop(backend, scheduler, TextEpisodes(tokenizer),
                  LoopSettings(total_steps=3, sampling=SamplingParams(max_new_tokens=4), seed=0, checkpoint_every=0,
                               eval_every=0, overlap=True, in_flight_updates=True),
                  on_step=lambda version, metrics, batch: trained.append([request_id(t.key) for t in batch]),
                  on_checkpoint=lambda version, state: None)
    asyncio.run(loop.run())

    # p1 (admitted at version 0) is over-stale at version 2 (S=1): cancelled while the engine still runs
    assert backend.calls[:3] == ["push 1", "push 2", "abort ['p1#0']"]
    assert backend.calls[3:] == ["pause", "push 3", "abort []"]  # only the final step pauses (its checkpoint)
    keys = [k for batch in trained for k in batch]
    assert len(trained) == 3 and len(keys) == 3 and "p1#0" not in keys
    summary = scheduler.ledger.summary()
    assert summary["dropped/stale"] == 1 and summary["trained"] == 3, summary
    assert "p1#0" not in loop.inflight  # its late generation came back and was discarded


def test_the_scripted_backends_finished_is_cancel_safe_and_returns_every_ended_request():
    """The shared finished() of the scripted backends (tests/scripted_backend.py) behaves as the loop needs."""
    async def main():
        backend = ScriptedBackend(slow={"a", "b"})
        backend.submit("a", [1], SamplingParams())
        backend.submit("b", [1], SamplingParams())
        waiting = asyncio.ensure_future(backend.finished())
        await asyncio.sleep(0)
        waiting.cancel()  # as the loop does before a weight push
        await asyncio.gather(waiting, return_exceptions=True)
        await backend.abort(["a", "b"])  # slow ones come back through finished() instead
        return await asyncio.wait_for(backend.finished(), 1)

    assert [g.request_id for g in asyncio.run(main())] == ["a", "b"]
