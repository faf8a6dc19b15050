"""Warm-start traces of multi-turn episodes as token rows, built the way the episode runner builds rows.

A demonstration is a first observation and a list of (turn text, observation after it) pairs. Its row uses
the same TurnRenderer as the rollouts (first prompt, forced observation tokens), so SFT trains on exactly
the layout RL later samples in; the target mask is 1 on the model's turns only. An observation's images are
expanded where the rollouts expand them; trace_images lists them for the SFT example.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from flashreinforce.envs.protocol import Observation, observation_images
from flashreinforce.envs.turns import TurnRenderer
from flashreinforce.types import Prompt


class Turn(NamedTuple):
    observation: Observation
    """What the agent saw before acting (the reset observation for the first turn)."""
    action: str


@dataclass(frozen=True)
class ExpertTrace:
    """One demonstration episode (a built-in environment's expert): the turns, what the last action led to, and
    whether it reached the goal."""

    turns: tuple[Turn, ...]
    final_observation: Observation
    success: bool


def trace_row(renderer: TurnRenderer, prompt: Prompt, first_observation: Observation,
              turns: Sequence[tuple[str, Observation | None]], *, final_eos: bool) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, completion ids, completion target mask) of one demonstrated episode.

    A turn with an observation is followed by its forced tokens; the last turn gets EOS when `final_eos`
    (an episode the model ends itself, e.g. a final answer) and nothing otherwise (the environment ends it).
    """
    tokenizer = renderer.tokenizer
    prompt_ids, conversation = renderer.first_prompt(prompt, first_observation)
    completion: list[int] = []
    mask: list[int] = []
    for j, (text, observation) in enumerate(turns):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if j == len(turns) - 1 and final_eos:
            ids.append(tokenizer.eos_token_id)
        completion += ids
        mask += [1] * len(ids)
        if observation is not None and j < len(turns) - 1:
            forced, conversation = renderer.observation_ids(conversation, ids, observation)
            completion += forced
            mask += [0] * len(forced)
    return prompt_ids, completion, mask


def trace_images(prompt: Prompt, first_observation: Observation,
                 turns: Sequence[tuple[str, Observation | None]]) -> tuple[bytes, ...]:
    """The images of trace_row's row, in placeholder order: the prompt's, the first observation's, then those of
    each observation the row shows (every turn's but the last)."""
    shown = [observation for _, observation in turns[:-1] if observation is not None]
    return (*prompt.images, *observation_images(first_observation),
            *(image for observation in shown for image in observation_images(observation)))
