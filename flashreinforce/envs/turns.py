"""Observations as forced tokens: what is appended to an episode's row after each model turn.

Token-in/token-out: the sampled ids stay as they are, only the new observation is tokenized, alone. Never
decoding the row and encoding it again is what keeps a BPE merge across the prompt/output boundary ("Alla"
is one token in one context and two in another, AReaL #647) out of the trained tokens.

With a chat template (chat-message prompts), an observation's tokens are the template's suffix for one
more message: the conversation rendered with and without it, and the difference taken. Before that suffix
comes what the template writes after an assistant message's end-of-turn token (Qwen's `\n` after
`<|im_end|>`, dropped at every assistant->tool boundary in verl #6501), and the end-of-turn token itself when
the turn stopped on a stop string instead. A step's several tool results are rendered together, so a
Qwen-style template merges them into one user turn (slime #2263). A template that rewrites earlier turns when
a message is appended (one that strips old think blocks) cannot be extended this way: it is detected when the
renderer is built, and said, rather than silently retokenizing.

Images: an observation's placeholders are expanded here, in the new tokens only (the prompt's and the reset
observation's together, in the first prompt), through the model's ImagePlaceholders, so each placeholder is
expanded exactly once; text already in the row is never rendered to ids again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flashreinforce.envs.protocol import ImageObservation, Message, Observation, observation_images
from flashreinforce.types import Prompt

if TYPE_CHECKING:  # the models package imports torch, which environment workers never load
    from flashreinforce.models.image_tokens import ImagePlaceholders

_PROBE = ({"role": "user", "content": "question"},
          {"role": "assistant", "content": "<think>\nreasoning\n</think>\n\nanswer"})


class TemplateNotAppendable(ValueError):
    """The chat template renders earlier turns differently once a message is appended."""


def as_messages(observation: Observation, role: str) -> list[Message]:
    if isinstance(observation, ImageObservation):
        return as_messages(observation.text, role)
    if isinstance(observation, str):
        return [{"role": role, "content": observation}]
    return [dict(m) for m in observation]


def as_text(observation: Observation) -> str:
    if isinstance(observation, ImageObservation):
        return as_text(observation.text)
    return observation if isinstance(observation, str) else "\n".join(m["content"] for m in observation)


def cut_text(text: str, limit: int) -> str:
    """An observation longer than `limit` characters keeps its head and says how much was cut."""
    return text if len(text) <= limit else f"{text[:limit]}\n[... {len(text) - limit} characters cut]"


def _limit(observation: Observation, limit: int) -> int | None:
    """The cut of an observation's text: none when it shows images (a cut could drop a placeholder and leave its
    image without a place; max_context still bounds the row)."""
    return None if observation_images(observation) else limit


def _cut(text: str, limit: int | None) -> str:
    return text if limit is None else cut_text(text, limit)


class TurnRenderer:
    """Renders first prompts and observations for one tokenizer; chat mode for chat-message prompts."""

    def __init__(self, tokenizer: Any, *, role: str = "user", max_observation_chars: int = 4000,
                 observation_suffix: str = "\n", images: ImagePlaceholders | None = None) -> None:
        """`images`: how the policy reads images (None: it reads none, and an observation with images is an
        error naming the fix)."""
        self.tokenizer, self.role, self.max_observation_chars = tokenizer, role, max_observation_chars
        self.images = images
        self.observation_suffix = observation_suffix
        """Plain text: what follows each observation (and a first observation follows the prompt after a
        newline), so the model reads where its next turn starts."""
        self._drop_ids = {i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None}
        self._close_id: int | None = None
        self._separator: list[int] = []
        if tokenizer.chat_template:
            self._close_id, self._separator = self._turn_ending()
            self._check_appendable()

    def _render(self, messages: Sequence[Message], *, generation_prompt: bool) -> list[int]:
        return list(self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt,
                                                       tokenize=True, return_dict=True)["input_ids"])

    def _turn_ending(self) -> tuple[int | None, list[int]]:
        """The end-of-turn token the template closes an assistant message with, and what follows it."""
        ids = self._render(_PROBE, generation_prompt=False)
        ends = [j for j, t in enumerate(ids) if t in self._drop_ids]
        if not ends:
            return self.tokenizer.eos_token_id, []
        return ids[ends[-1]], ids[ends[-1] + 1:]

    def _check_appendable(self) -> None:
        base = self._render(_PROBE, generation_prompt=False)
        extended = self._render([*_PROBE, *as_messages("observation", self.role)], generation_prompt=True)
        if extended[: len(base)] != base:
            raise TemplateNotAppendable(
                f"the tokenizer's chat template renders earlier turns differently once a {self.role!r} message is "
                "appended (for example it strips old <think> blocks), so multi-turn rows cannot be built by "
                "appending observation tokens without retokenizing what the model sampled; give the tokenizer a "
                "template that keeps earlier turns as they were (tokenizer.chat_template), or set env.role to a "
                "role the template appends cleanly")

    # ---- the episode's text -----------------------------------------------------------------------------

    def _expand(self, ids: list[int], images: Sequence[bytes], where: str) -> list[int]:
        """New ids with each placeholder expanded to its image's run of image tokens (the only expansion)."""
        if self.images is None:
            if images:
                raise ValueError(f"{where} has {len(images)} images but the model reads none: set "
                                 "model.tiny.vision, or use a vision-language model.path")
            return ids
        return self.images.expand(ids, images, where=where)

    def _encode(self, text: str) -> list[int]:
        """Plain text to ids, each IMAGE_TOKEN written the model's way first."""
        rendered = text if self.images is None else self.images.render(text)
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def _render_messages(self, messages: Sequence[Message], *, generation_prompt: bool) -> list[int]:
        if self.images is not None:
            messages = [{**m, "content": self.images.render(m["content"])} for m in messages]
        return self._render(messages, generation_prompt=generation_prompt)

    def first_prompt(self, prompt: Prompt, observation: Observation) -> tuple[list[int], tuple[Message, ...] | None]:
        """The first turn's prompt ids: the task and the reset observation, whose images (the prompt's, then the
        observation's: `prompt.images + observation_images(observation)`) are expanded here; the conversation in
        chat mode."""
        text = _cut(as_text(observation), _limit(observation, self.max_observation_chars))
        if isinstance(prompt.prompt, str):
            first = f"\n{text}{self.observation_suffix}" if text else ""
            ids = self._encode(prompt.prompt + first)
            conversation = None
        else:
            if not self.tokenizer.chat_template:
                raise ValueError(f"prompt {prompt.id} is chat messages but the tokenizer has no chat template")
            messages = [dict(m) for m in prompt.prompt]
            if text and messages and messages[-1]["role"] == "user":
                messages[-1]["content"] = f"{messages[-1]['content']}\n\n{text}"
            elif text:
                messages.append({"role": "user", "content": text})
            ids, conversation = self._render_messages(messages, generation_prompt=True), tuple(messages)
        if not ids:
            raise ValueError(f"prompt {prompt.id} renders to zero tokens")
        images = (*prompt.images, *observation_images(observation))
        return self._expand(ids, images, f"prompt {prompt.id} with its reset observation"), conversation

    def action_text(self, turn_ids: Sequence[int]) -> str:
        """What the environment reads: the turn's text without end-of-turn / padding tokens."""
        return self.tokenizer.decode([t for t in turn_ids if t not in self._drop_ids], skip_special_tokens=False)

    def observation_ids(self, conversation: tuple[Message, ...] | None, turn_ids: Sequence[int],
                        observation: Observation) -> tuple[list[int], tuple[Message, ...] | None]:
        """Forced ids that follow the sampled turn `turn_ids`, and the conversation after this step. The
        observation's images are expanded in these ids only: the conversation before it is never rendered to
        ids again (its placeholders were expanded when they were new)."""
        images, limit = observation_images(observation), _limit(observation, self.max_observation_chars)
        where = "an observation"
        if conversation is None:
            ids = self._encode(_cut(as_text(observation), limit) + self.observation_suffix)
            return self._expand(ids, images, where), None
        messages = [dict(m, content=_cut(m["content"], limit)) for m in as_messages(observation, self.role)]
        history = [*conversation, {"role": "assistant", "content": self.action_text(turn_ids)}]
        base = self._render_messages(history, generation_prompt=False)
        extended = self._render_messages([*history, *messages], generation_prompt=True)
        if extended[: len(base)] != base:
            raise TemplateNotAppendable(f"the chat template re-rendered earlier turns when {len(messages)} "
                                        f"{self.role!r} message(s) were appended; cannot extend the row")
        closing = [] if turn_ids and turn_ids[-1] in self._drop_ids or self._close_id is None else [self._close_id]
        new = self._expand(extended[len(base):], images, where)
        return [*closing, *self._separator, *new], (*history, *messages)
