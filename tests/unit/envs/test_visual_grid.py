"""The visual grid: layouts, pictures, rules, held-out splits, the expert's demonstrations and the warm-start rows."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
from PIL import Image

from flashreinforce.config import load_config
from flashreinforce.envs import visual_grid
from flashreinforce.envs.protocol import ENV_KINDS, ImageObservation, as_step_result, check_observation
from flashreinforce.envs.visual_grid import (
    AGENT,
    GOAL,
    GridLayout,
    VisualGridEnv,
    draw_grid,
    make_layout,
    noisy_expert_trace,
    play_turn,
    solve,
    visual_grid_prompts,
)
from flashreinforce.models.image_tokens import IMAGE_TOKEN
from flashreinforce.run.policy import tiny_tokenizer
from flashreinforce.run.tasks import TASKS, tiny_vision_config
from flashreinforce.trainer.sft import ImageExample
from flashreinforce.types import Prompt


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def cells_of(png: bytes, size: int, colour: tuple[int, int, int]) -> list[tuple[int, int]]:
    """The cells whose centre pixel is `colour`."""
    image, cell = pixels(png), pixels(png).shape[0] // size
    return [(x, y) for y in range(size) for x in range(size)
            if tuple(image[y * cell + cell // 2, x * cell + cell // 2]) == colour]


def test_the_picture_shows_the_agent_and_the_goal_in_their_cells_and_nothing_else():
    layout = GridLayout(4, start=(0, 3), goal=(2, 1))
    png = draw_grid(layout, (1, 3), image_size=64)
    assert pixels(png).shape == (64, 64, 3)
    assert cells_of(png, 4, AGENT) == [(1, 3)] and cells_of(png, 4, GOAL) == [(2, 1)]
    assert {tuple(p) for p in pixels(png).reshape(-1, 3)} == {AGENT, GOAL, (255, 255, 255)}  # no blending
    assert draw_grid(layout, (1, 3), image_size=64) == png  # the same bytes every time (replay, resume)


def test_layouts_are_deterministic_and_never_start_next_to_the_goal():
    assert make_layout(42, 4) == make_layout(42, 4)
    layouts = {make_layout(seed, 4) for seed in range(300)}
    assert all(visual_grid.distance(layout.start, layout.goal) >= 2 for layout in layouts)
    assert len({layout.goal for layout in layouts}) == 16  # goals everywhere: no answer that fits all
    with pytest.raises(ValueError, match="size=9 must be an int in"):
        make_layout(1, 9)


def test_moves_walls_invalid_text_and_the_reward():
    layout = GridLayout(3, start=(0, 0), goal=(2, 0))
    agent, result = play_turn(layout, (0, 0), "up\n", 1, 4, 32)  # off the top edge: stays, says so
    assert agent == (0, 0) and not result.done and result.observation.text == f"wall.\n{IMAGE_TOKEN}move:"
    agent, result = play_turn(layout, agent, "north", 2, 4, 32)
    assert agent == (0, 0) and result.info["invalid"] and result.observation.text.startswith("invalid move.")
    agent, result = play_turn(layout, agent, "right", 3, 4, 32)
    assert agent == (1, 0) and result.observation.text == f"{IMAGE_TOKEN}move:" and result.reward == 0.0
    assert cells_of(result.observation.images[0], 3, AGENT) == [(1, 0)]
    check_observation(result.observation, "visual_grid turn 3")  # what the worker checks
    agent, result = play_turn(layout, agent, "right\nthen more", 4, 4, 32)  # the first line is the move
    assert (agent, result.reward, result.done, result.info["success"]) == ((2, 0), 1.0, True, True)
    _, result = play_turn(layout, (0, 0), "right", 4, 4, 32)  # the last turn without the goal
    assert (result.observation, result.reward, result.done, result.info["success"]) == ("out of moves.", 0.0,
                                                                                         True, False)


def test_the_env_plays_a_prompts_layout_deterministically():
    prompt = visual_grid_prompts(1, split="train", seed=3)[0]
    layout = visual_grid.layout_of(prompt)
    runs = []
    for _ in range(2):
        env = VisualGridEnv(max_steps=8, image_size=32)
        first = env.reset(prompt, seed=123)
        assert isinstance(first, ImageObservation) and cells_of(first.images[0], 4, AGENT) == [layout.start]
        results = [as_step_result(env.step(move), "visual_grid") for move in solve(layout)]
        runs.append((first, results))
        env.close()
    assert runs[0] == runs[1]
    assert [r.done for r in runs[0][1]] == [False] * (len(solve(layout)) - 1) + [True]
    assert runs[0][1][-1].reward == 1.0 and ENV_KINDS["visual_grid"].endswith(":VisualGridEnv")
    with pytest.raises(ValueError, match="prompt bad: visual grid ground truth"):
        VisualGridEnv().reset(Prompt("bad", "reach the goal.", "layout:1"), 0)


def test_prompts_are_distinct_held_out_layouts_and_give_no_position_away():
    train = visual_grid_prompts(120, split="train", seed=1)
    held_out = visual_grid_prompts(40, split="eval", seed=1)
    train_layouts = {visual_grid.layout_of(p) for p in train}
    held_layouts = {visual_grid.layout_of(p) for p in held_out}
    assert len(train_layouts) == 120 and len(held_layouts) == 40 and not train_layouts & held_layouts
    assert {p.prompt for p in [*train, *held_out]} == {"reach the goal."}  # the pictures alone say where
    assert all(p.modality == "image" and not p.images for p in train)  # the pictures come from the env
    assert visual_grid_prompts(5, split="train", seed=1) == train[:5]
    with pytest.raises(ValueError, match="found only 43 distinct eval layouts of a 4x4 grid"):
        visual_grid_prompts(44, split="eval", seed=1)


def test_expert_traces_reach_the_goal_and_a_noisy_one_recovers():
    layout = make_layout(5, 4)
    perfect = noisy_expert_trace(layout, random.Random(0), 0.0, image_size=32)
    assert perfect.success and [t.action for t in perfect.turns] == solve(layout)
    assert all(isinstance(t.observation, ImageObservation) for t in perfect.turns)
    noisy = [noisy_expert_trace(layout, random.Random(seed), 0.5, max_steps=12, image_size=32) for seed in range(20)]
    assert any(len(t.turns) > len(solve(layout)) and t.success for t in noisy)  # wrong moves, then recovered


def test_the_warm_start_rows_hold_each_picture_once_and_train_only_the_moves():
    config = load_config("visual_grid", ["data.visual_grid.num_train=8", "env.options={max_steps: 4, image_size: 32}",
                                         "model.tiny.vision={image_size: 32, merge: 2}"])
    tokenizer = tiny_tokenizer(config)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    run = tiny_vision_config(config, tokenizer).tokens_per_image
    train, _ = TASKS["visual_grid"].splits(config)
    examples = TASKS["visual_grid"].sft_examples(config, tokenizer, train)
    assert len(examples) == 8 and all(isinstance(e, ImageExample) for e in examples)
    for example in examples:
        row = [*example.prompt_ids, *example.completion_ids]
        assert row.count(image_id) == run * len(example.images) and len(example.images) >= 2
        targets = [t for t, m in zip(example.completion_ids, example.completion_mask) if m]
        assert image_id not in targets and set(tokenizer.decode(targets).split("\n")) <= {"up", "down", "left",
                                                                                          "right", ""}
