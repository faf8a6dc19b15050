"""Single-turn text episodes: the tokenization boundary between prompts, the engine and the trainer.

A prompt is rendered to token ids once (plain text, or chat messages through the tokenizer's chat
template); the engine's Generation is appended to it to form one Trajectory row. Nothing here is
retokenized after sampling: the trained tokens are exactly the sampled ones (a common multi-turn bug).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flashreinforce.models.image_tokens import ImagePlaceholders
from flashreinforce.types import (
    FORCED_VERSION,
    Generation,
    Prompt,
    RolloutKey,
    Trajectory,
    Verdict,
)


class TextEpisodes:
    """Renders prompts and completions with one tokenizer."""

    def __init__(self, tokenizer: Any, images: ImagePlaceholders | None = None) -> None:
        """`images`: how the policy reads images (None: it reads none, and a prompt with images is an error)."""
        self.tokenizer = tokenizer
        self.images = images
        self._drop_ids = {i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None}

    def prompt_ids(self, prompt: Prompt, hint_ids: Sequence[int] = ()) -> list[int]:
        """Token ids of the prompt, followed by AHRL hint tokens if any."""
        render = self.images.render if self.images is not None else str
        if isinstance(prompt.prompt, str):
            ids = self.tokenizer.encode(render(prompt.prompt), add_special_tokens=False)
        else:
            if not self.tokenizer.chat_template:
                raise ValueError(f"prompt {prompt.id} is chat messages but the tokenizer has no chat template; "
                                 "give the tokenizer one (tokenizer.chat_template) or use plain-text prompts")
            # return_dict: one return type across transformers versions (5.x gives a BatchEncoding, not a dict).
            messages = [{**message, "content": render(message["content"])} for message in prompt.prompt]
            ids = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                          tokenize=True, return_dict=True)["input_ids"])
        if not ids:
            raise ValueError(f"prompt {prompt.id} renders to zero tokens")
        return [*self._with_images(prompt, ids), *hint_ids]

    def _with_images(self, prompt: Prompt, ids: list[int]) -> list[int]:
        """The placeholders expanded to each image's run of image tokens (the one place that happens)."""
        if self.images is None:
            if prompt.images:
                raise ValueError(f"prompt {prompt.id} has {len(prompt.images)} images but the model reads none: "
                                 "set model.tiny.vision, or use a vision-language model.path")
            return ids
        return self.images.expand(ids, prompt.images, where=f"prompt {prompt.id}")

    def completion_text(self, generation: Generation) -> str:
        """What the verifier reads: the response without EOS / padding tokens."""
        ids = [t for t in generation.token_ids if t not in self._drop_ids]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def to_trajectory(
    key: RolloutKey,
    prompt: Prompt,
    group: int,
    generation: Generation,
    verdict: Verdict,
    hint_length: int = 0,
) -> Trajectory:
    """Prompt ids + generation -> one aligned row (prompt positions: mask 0, logprob 0, FORCED_VERSION); an agent
    episode's other segments (EpisodeState.segments) become its `segments`, rows of the same key and verdict."""
    segments = generation.episode.segments if generation.episode is not None else ()
    prompt_length = len(generation.prompt_ids)
    return Trajectory(
        key=key,
        prompt=prompt,
        group=group,
        tokens=(*generation.prompt_ids, *generation.token_ids),
        loss_mask=(0,) * prompt_length + tuple(generation.loss_mask),
        behavior_logprobs=(0.0,) * prompt_length + tuple(generation.behavior_logprobs),
        policy_versions=(FORCED_VERSION,) * prompt_length + tuple(generation.policy_versions),
        prompt_length=prompt_length,
        finish_reason=generation.finish_reason,
        verdict=verdict,
        hint_length=hint_length,
        episode=generation.episode,
        routes=generation.routes,
        stale_context=generation.stale_context,
        images=generation.images,
        segments=tuple(to_trajectory(key, prompt, group, segment, verdict) for segment in segments),
    )
