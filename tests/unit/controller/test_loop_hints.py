"""AHRL in the loop: every rollout of a group gets one hinted prompt, even when its siblings are admitted
one slot at a time across weight pushes (ALGORITHMS.md 1.4: the G rollouts of x at step t share x~)."""

import asyncio
from collections import defaultdict

import pytest
from test_loop_in_flight import ScriptedBackend

from flashreinforce.buffer import build_scheduler
from flashreinforce.controller.loop import LoopSettings, RLLoop
from flashreinforce.envs.hints import HintedPrompts
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.models import build_char_tokenizer
from flashreinforce.types import Prompt, SamplingParams

THINK = "7+5+0=12;3+8+1=12;0+4+1=5;" * 2


class FewSlots(ScriptedBackend):
    """Three slots, finished requests included until handed back: a group of four never starts at once."""

    def __init__(self) -> None:
        super().__init__(slow=set())
        self.submitted: dict[str, tuple[tuple[int, ...], int]] = {}  # request id -> (prompt ids, engine version)

    @property
    def free_slots(self) -> int:
        return 3 - len(self.running) - len(self.done)

    def submit(self, rid, prompt_ids, params, prefix=None):
        self.submitted[rid] = (tuple(prompt_ids), self.version)
        super().submit(rid, prompt_ids, params, prefix)


@pytest.mark.parametrize("kind, options", [("stream", {"max_staleness": 2}), ("urb", {"buffer_size": 2}),
                                           ("april", {})])  # sync never admits a group across a push
def test_every_rollout_of_a_group_gets_the_hint_of_the_step_its_group_started_at(kind, options):
    prompts = [Prompt(f"p{i}", "37+485=", "522", reference_think=THINK) for i in range(40)]
    tokenizer = build_char_tokenizer("0123456789+=;")
    episodes = TextEpisodes(tokenizer)
    hints = HintedPrompts(episodes, {p.id: 0.5 for p in prompts}, p_initial=1.0, gamma=0.5, pass_threshold=1.0,
                          pass_floor=0.0, think_open="<think>")  # a fast decay: every step shortens the hint
    scheduler = build_scheduler(kind, prompt_at=prompts.__getitem__, batch_groups=1, group_size=4, **options)
    backend = FewSlots()
    loop = RLLoop(backend, scheduler, episodes,
                  LoopSettings(total_steps=4, sampling=SamplingParams(max_new_tokens=4), seed=0, checkpoint_every=0,
                               eval_every=0, overlap=True, in_flight_updates=True),
                  on_step=lambda version, metrics, batch: None, on_checkpoint=lambda version, state: None, hints=hints)
    asyncio.run(loop.run())

    by_prompt = defaultdict(list)  # one group per prompt here: its rollouts are the prompt's samples
    for rid, (ids, version) in backend.submitted.items():
        by_prompt[rid.split("#")[0]].append((ids, version))
    split = [p for p, rollouts in by_prompt.items() if len({v for _, v in rollouts}) > 1]
    assert split, "no group was admitted across a weight push: the test would prove nothing"
    for prompt_id, rollouts in by_prompt.items():
        prompt = prompts[int(prompt_id[1:])]
        first = min(v for _, v in rollouts)
        assert {ids for ids, _ in rollouts} == {tuple(hints.prompt_ids(prompt, first))}, prompt_id
