"""The built-in tasks by `data.kind`: their prompts, the tiny model's tokenizer, and the warm-start traces.

A task gives train / held-out prompts, the characters and special tokens of the character tokenizer the tiny
model is built with, and SFT examples: imperfect demonstrations, so RL has something to fix. Agent tasks'
demonstrations are whole episodes, rendered by the same TurnRenderer as the rollouts (envs/traces.py). A task an
agent of the user's own can train on (env.kind=agent) may also demonstrate answers to the agent's calls
(`demonstrate`, run/agent_demos.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from flashreinforce.config import RunConfig
from flashreinforce.data import arithmetic, instructions, tool_multiply, vision_tasks
from flashreinforce.envs import text_game, visual_grid
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.envs.traces import trace_images, trace_row
from flashreinforce.envs.turns import TurnRenderer
from flashreinforce.models.image_tokens import IMAGE_TOKEN, ImagePlaceholders
from flashreinforce.models.vision import VisionConfig
from flashreinforce.trainer.sft import ImageExample
from flashreinforce.types import Prompt

Example = tuple[list[int], list[int]] | tuple[list[int], list[int], list[int]]
Demonstrate = Callable[[RunConfig, Prompt, Sequence[dict[str, Any]], Sequence[dict[str, Any]], random.Random],
                       dict[str, Any]]
"""(config, the episode's prompt, a call's messages, its tools, the episode's generator) -> the assistant message
that answers the call."""


@dataclass(frozen=True)
class Task:
    alphabet: str
    special_tokens: tuple[str, ...]
    """Whole-word tokens of the character tokenizer, after <pad> <eos> <unk>."""
    splits: Callable[[RunConfig], tuple[list[Prompt], list[Prompt]]]
    sft_examples: Callable[[RunConfig, Any, list[Prompt]], list[Example]]
    demonstrate: Demonstrate | None = None
    """Answers to an agent's calls (env.kind=agent) for its warm start; None: the task has none."""


def _arithmetic_splits(config: RunConfig) -> tuple[list[Prompt], list[Prompt]]:
    settings = config.data.arithmetic
    splits = arithmetic.make_arithmetic_splits(settings.num_train, settings.num_eval, seed=settings.seed,
                                               digit_weights=settings.digit_weights)
    return splits.train, splits.eval


def _arithmetic_examples(config: RunConfig, tokenizer: Any, train: list[Prompt]) -> list[Example]:
    """Worked sums with sft.carry_drop of the carries dropped."""
    episodes, rng = TextEpisodes(tokenizer), random.Random(config.seed)
    return [(episodes.prompt_ids(item),
             [*tokenizer.encode(arithmetic.render_target(item, carry_drop=config.sft.carry_drop, rng=rng),
                                add_special_tokens=False), tokenizer.eos_token_id])
            for item in train]


def _tool_multiply_splits(config: RunConfig) -> tuple[list[Prompt], list[Prompt]]:
    settings = config.data.tool_multiply
    return tool_multiply.make_tool_multiply_splits(settings.num_train, settings.num_eval, seed=settings.seed,
                                                   digits=settings.digits, chat=settings.chat)


def renderer_for(config: RunConfig, tokenizer: Any, images: ImagePlaceholders | None = None) -> TurnRenderer:
    """The task's observation rendering; `images`: the policy's placeholders (None: it reads no images)."""
    env = config.env
    return TurnRenderer(tokenizer, role=env.role, max_observation_chars=env.max_observation_chars,
                        observation_suffix=env.observation_suffix, images=images)


def _tool_multiply_examples(config: RunConfig, tokenizer: Any, train: list[Prompt]) -> list[Example]:
    """Episodes that call the tool (sft.tool_rate, some with wrong code) or answer mentally."""
    renderer, rng = renderer_for(config, tokenizer), random.Random(config.seed)
    examples = []
    for item in train:
        turns = tool_multiply.tool_trace(item, rng, tool_rate=config.sft.tool_rate,
                                         wrong_code_rate=config.sft.wrong_code_rate)
        examples.append(trace_row(renderer, item, "", [(t.action, t.observation) for t in turns], final_eos=True))
    return examples


def _tool_multiply_demonstration(config: RunConfig, prompt: Prompt, messages: Sequence[dict[str, Any]],
                                 tools: Sequence[dict[str, Any]], rng: random.Random) -> dict[str, Any]:
    """The tool (sft.tool_rate of the episodes, some with wrong code) or a mental answer, as the agent's turns."""
    return tool_multiply.demonstrate(prompt, messages, tools, rng, tool_rate=config.sft.tool_rate,
                                     wrong_code_rate=config.sft.wrong_code_rate)


def _instructions_splits(config: RunConfig) -> tuple[list[Prompt], list[Prompt]]:
    settings = config.data.instructions
    return instructions.make_instructions_splits(settings.num_train, settings.num_eval, seed=settings.seed,
                                                 constraints=settings.constraints,
                                                 constraint_weights=settings.constraint_weights, chat=settings.chat)


def _instructions_examples(config: RunConfig, tokenizer: Any, train: list[Prompt]) -> list[Example]:
    """Answers that violate each constraint with probability data.instructions.violation_rate."""
    episodes, rng = TextEpisodes(tokenizer), random.Random(config.seed)
    rate = config.data.instructions.violation_rate
    return [(episodes.prompt_ids(item),
             [*tokenizer.encode(instructions.demonstration(item, rng, rate), add_special_tokens=False),
              tokenizer.eos_token_id])
            for item in train]


def _text_game_splits(config: RunConfig) -> tuple[list[Prompt], list[Prompt]]:
    settings = config.data.text_game
    options = {"rooms": settings.rooms, "locked_doors": settings.locked_doors, "distractors": settings.distractors}
    return (text_game.text_game_prompts(settings.num_train, split="train", seed=settings.seed, **options),
            text_game.text_game_prompts(settings.num_eval, split="eval", seed=settings.seed, **options))


def _text_game_examples(config: RunConfig, tokenizer: Any, train: list[Prompt]) -> list[Example]:
    """The oracle's play with sft.expert_error_rate of its turns replaced by wrong actions (some traces fail)."""
    renderer, rng = renderer_for(config, tokenizer), random.Random(config.seed)
    max_steps = int(config.env.options.get("max_steps", 8))
    examples = []
    for item in train:
        trace = text_game.noisy_expert_trace(text_game.layout_of(item), rng, config.sft.expert_error_rate,
                                             max_steps=max_steps)
        observations = [turn[0] for turn in trace.turns][1:] + [trace.final_observation]
        turns = [(f"{turn[1]}\n", observation) for turn, observation in zip(trace.turns, observations)]
        examples.append(trace_row(renderer, item, trace.turns[0][0], turns, final_eos=False))
    return examples


def _vision_splits(config: RunConfig) -> tuple[list[Prompt], list[Prompt]]:
    settings = config.data.vision
    return vision_tasks.make_vision_splits(settings.num_train, settings.num_eval, seed=settings.seed,
                                           tasks=settings.tasks, image_size=settings.image_size,
                                           task_weights=settings.task_weights)


def tiny_vision_config(config: RunConfig, tokenizer: Any) -> VisionConfig | None:
    """The tiny model's encoder (model.tiny.vision) with its tokenizer's IMAGE_TOKEN; None for a text-only one."""
    vision = config.model.tiny.vision
    if vision is None:
        return None
    return VisionConfig(**vision.model_dump(), image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))


def tiny_placeholders(config: RunConfig, tokenizer: Any) -> ImagePlaceholders | None:
    """How the tiny model reads images: its IMAGE_TOKEN, filled by the encoder's tokens; None for a text-only one."""
    vision = tiny_vision_config(config, tokenizer)
    return None if vision is None else ImagePlaceholders(vision.image_token_id, vision.tokens_per_image)


def _vision_examples(config: RunConfig, tokenizer: Any, train: list[Prompt]) -> list[Example]:
    """Answers that are another of the task's answers with probability sft.answer_error_rate."""
    episodes = TextEpisodes(tokenizer, tiny_placeholders(config, tokenizer))
    rng = random.Random(config.seed)
    return [ImageExample(episodes.prompt_ids(item),
                         [*tokenizer.encode(vision_tasks.demonstration(item, rng, config.sft.answer_error_rate),
                                            add_special_tokens=False), tokenizer.eos_token_id],
                         item.images)
            for item in train]


def _visual_grid_splits(config: RunConfig) -> tuple[list[Prompt], list[Prompt]]:
    settings = config.data.visual_grid
    return (visual_grid.visual_grid_prompts(settings.num_train, split="train", seed=settings.seed, size=settings.size),
            visual_grid.visual_grid_prompts(settings.num_eval, split="eval", seed=settings.seed, size=settings.size))


def _visual_grid_examples(config: RunConfig, tokenizer: Any, train: list[Prompt]) -> list[Example]:
    """The oracle's moves with sft.expert_error_rate of them replaced by other moves (some traces fail), each
    turn's picture in the row as the rollouts have it."""
    renderer = renderer_for(config, tokenizer, tiny_placeholders(config, tokenizer))
    rng, options = random.Random(config.seed), config.env.options
    max_steps, image_size = int(options.get("max_steps", 8)), int(options.get("image_size", 64))
    examples = []
    for item in train:
        trace = visual_grid.noisy_expert_trace(visual_grid.layout_of(item), rng, config.sft.expert_error_rate,
                                               max_steps=max_steps, image_size=image_size)
        observations = [turn.observation for turn in trace.turns][1:] + [trace.final_observation]
        turns = [(f"{turn.action}\n", observation) for turn, observation in zip(trace.turns, observations)]
        first = trace.turns[0].observation
        prompt_ids, completion, mask = trace_row(renderer, item, first, turns, final_eos=False)
        examples.append(ImageExample(prompt_ids, completion, trace_images(item, first, turns), mask))
    return examples


TASKS: dict[str, Task] = {
    "arithmetic": Task("".join(c for c in arithmetic.ALPHABET if c not in (arithmetic.THINK_OPEN, arithmetic.THINK_CLOSE)),
                       (arithmetic.THINK_OPEN, arithmetic.THINK_CLOSE), _arithmetic_splits, _arithmetic_examples),
    "tool_multiply": Task(tool_multiply.ALPHABET, tool_multiply.SPECIAL_TOKENS, _tool_multiply_splits,
                          _tool_multiply_examples, _tool_multiply_demonstration),
    "text_game": Task(text_game.TEXT_GAME_ALPHABET, (), _text_game_splits, _text_game_examples),
    "instructions": Task(instructions.ALPHABET, (), _instructions_splits, _instructions_examples),
    "vision": Task(vision_tasks.ALPHABET, (IMAGE_TOKEN,), _vision_splits, _vision_examples),
    "visual_grid": Task(visual_grid.ALPHABET, (IMAGE_TOKEN,), _visual_grid_splits, _visual_grid_examples),
}
