"""AHRL, Adaptive Hint-based RL (ERNIE 5.0 eq. 5; ALGORITHMS.md 1.4): how much of a reference thought to reveal.

Pure Python on token ids: no torch, no tokenizer. A hard prompt gets the first L tokens of a reference
"think" appended, and L shrinks as training goes on, faster for prompts the SFT model already passes.
The hint is PROMPT: whoever builds the trajectory gives it loss_mask 0 (Trajectory.hint_length).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def hint_fraction(step: int, pass_initial: float, *, p_initial: float, gamma: float, pass_floor: float = 0.0) -> float:
    """p_hint(x, t) = p_initial * exp(-gamma * t * max(pass_x^initial, pass_floor)).

    t = `step` is the 0-based global RL iteration, pass_x^initial the prompt's pass@k on the SFT model.
    With pass_floor = 0 (literal eq. 5) a never-solved prompt keeps p_initial for ever; a floor such as
    1/k makes every hint fade. Example: p_initial 0.8, gamma 0.01, t 100, pass 0.5 -> 0.8 e^-0.5 = 0.485.
    """
    if step < 0:
        raise ValueError(f"step={step} must be >= 0 (the 0-based RL iteration)")
    if not 0 <= p_initial <= 1:
        raise ValueError(f"p_initial={p_initial} must be a fraction in [0, 1]")
    if gamma < 0 or not 0 <= pass_initial <= 1 or not 0 <= pass_floor <= 1:
        raise ValueError(f"gamma={gamma} must be >= 0, and pass_initial={pass_initial} and "
                         f"pass_floor={pass_floor} in [0, 1]")
    return p_initial * math.exp(-gamma * step * max(pass_initial, pass_floor))


def hinted_prompt(
    prompt_ids: Sequence[int],
    think_ids: Sequence[int],
    fraction: float,
    *,
    think_open_ids: Sequence[int] = (),
) -> tuple[tuple[int, ...], int]:
    """(prompt + think_open + think[:L], number of hint tokens appended), L = floor(fraction * |think|).

    `think_open_ids` is the `<think>` opener, for chat templates that do not emit it themselves. When
    L = 0 nothing is appended, the opener included, so the prompt is identical to the unhinted one.
    Example: prompt (1, 2), think (7, 8, 9), fraction 0.7, opener (5,) -> ((1, 2, 5, 7, 8), 3).
    """
    if not 0 <= fraction <= 1:
        raise ValueError(f"hint fraction={fraction} must be in [0, 1]")
    length = math.floor(fraction * len(think_ids))
    if length == 0:
        return tuple(prompt_ids), 0
    hint = (*think_open_ids, *think_ids[:length])
    return (*prompt_ids, *hint), len(hint)
