"""AHRL prompts (ERNIE 5.0 §4.3): hard prompts get the first part of their reference think, fading with steps.

The schedule is `algorithms.hints`; this module applies it to token ids. Hint tokens are prompt: they
have loss_mask 0, and the trajectory records how many there were (Trajectory.hint_length).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from flashreinforce.algorithms.hints import hint_fraction, hinted_prompt
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.types import Prompt


class HintedPrompts:
    """prompt_ids(prompt, step) with the AHRL hint of that step appended when the prompt qualifies.

    A prompt qualifies when it has a reference think and its initial pass@k (on the warm-start model) is at
    most `pass_threshold`. Its hint is floor(p_hint * |think tokens|) tokens, p_hint = p_initial *
    exp(-gamma * t * max(pass, pass_floor)), t = step - first_step: the steps of the run (of a pipeline's
    stage) so far. The loop renders a group's prompt at the step its first rollout was admitted
    (RolloutTask.group_version), so all G rollouts of a group share one hinted prompt.
    """

    def __init__(
        self,
        episodes: TextEpisodes,
        pass_initial: Mapping[str, float],
        *,
        p_initial: float,
        gamma: float,
        pass_threshold: float,
        pass_floor: float,
        think_open: str,
        first_step: int = 0,
    ) -> None:
        self.episodes = episodes
        self.first_step = first_step
        self.pass_initial = dict(pass_initial)
        self.p_initial, self.gamma = p_initial, gamma
        self.pass_threshold, self.pass_floor = pass_threshold, pass_floor
        tokenizer = episodes.tokenizer
        self._think_open = tokenizer.encode(think_open, add_special_tokens=False) if think_open else []

    def qualifies(self, prompt: Prompt) -> bool:
        return prompt.reference_think is not None and self.pass_initial.get(prompt.id, 1.0) <= self.pass_threshold

    def prompt_ids(self, prompt: Prompt, step: int) -> list[int]:
        if not self.qualifies(prompt):
            return self.episodes.prompt_ids(prompt)
        fraction = hint_fraction(step - self.first_step, self.pass_initial[prompt.id], p_initial=self.p_initial,
                                 gamma=self.gamma, pass_floor=self.pass_floor)
        return render_hinted(self.episodes, prompt, fraction, self._think_open)

    def hint_ids(self, prompt: Prompt, step: int) -> list[int]:
        """The hint tokens of `prompt` at `step` alone (none when it does not qualify): what follows the prompt,
        whatever an environment's first observation adds to it."""
        return self.prompt_ids(prompt, step)[len(self.episodes.prompt_ids(prompt)):]


def render_hinted(episodes: TextEpisodes, prompt: Prompt, fraction: float, think_open_ids: list[int]) -> list[int]:
    """The prompt's ids followed by the first `fraction` of its reference think (and the opener, unless the
    rendered prompt already ends with it: a template that emits <think>)."""
    ids = episodes.prompt_ids(prompt)
    think = episodes.tokenizer.encode(prompt.reference_think, add_special_tokens=False)
    opens_already = bool(think_open_ids) and ids[-len(think_open_ids):] == think_open_ids
    hinted, _ = hinted_prompt(ids, think, fraction, think_open_ids=[] if opens_already else think_open_ids)
    return list(hinted)


def longest_hinted_prompt(episodes: TextEpisodes, prompts: Sequence[Prompt], *, p_initial: float,
                          think_open: str) -> int:
    """The most tokens any of `prompts` can take with its hint: what the engine's context must hold on top
    of the generation budget. Known before the pass rates: p_hint is largest at step 0 (p_initial, it
    never grows), and every prompt with a reference think is taken to qualify."""
    opener = episodes.tokenizer.encode(think_open, add_special_tokens=False) if think_open else []
    return max(len(render_hinted(episodes, p, p_initial, opener)) if p.reference_think is not None
               else len(episodes.prompt_ids(p)) for p in prompts)
