import io
import random
import time
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from flashreinforce.data.vision_tasks import (
    ALPHABET,
    ANSWERS,
    COLOURS,
    GRID,
    VISION_TASKS,
    demonstration,
    make_vision_splits,
)
from flashreinforce.models.image_tokens import IMAGE_TOKEN

TRAIN, HELD_OUT = make_vision_splits(1500, 300, seed=11, tasks=VISION_TASKS)


def _pixels(item) -> np.ndarray:
    with Image.open(io.BytesIO(item.images[0])) as image:
        return np.asarray(image.convert("RGB"))


def _cell_colours(pixels: np.ndarray) -> Counter:
    """How many grid cells hold each colour, read off the pixels (a cell holds at most one shape)."""
    cell, found = pixels.shape[0] // GRID, Counter()
    for row in range(GRID):
        for column in range(GRID):
            block = pixels[row * cell:(row + 1) * cell, column * cell:(column + 1) * cell].reshape(-1, 3)
            colours = [name for name, rgb in COLOURS.items() if (block == rgb).all(axis=1).sum() >= 10]
            assert len(colours) <= 1, f"cell ({row}, {column}) holds {colours}"
            found.update(colours)
    return found


def _bar_heights(pixels: np.ndarray) -> list[int]:
    cell = pixels.shape[1] // GRID
    painted = (pixels != 255).any(axis=2)
    return [int(painted[:, c * cell:(c + 1) * cell].any(axis=1).sum()) for c in range(GRID)]


def test_the_same_arguments_give_byte_identical_images_and_splits_differ():
    train, held_out = make_vision_splits(1500, 300, seed=11, tasks=VISION_TASKS)
    assert (train, held_out) == (TRAIN, HELD_OUT)
    # Item i of a split depends on the seed and split alone, not on the other split's size.
    assert make_vision_splits(20, 0, seed=11, tasks=VISION_TASKS)[0] == TRAIN[:20]
    assert {p.images for p in HELD_OUT[:50]}.isdisjoint(p.images for p in TRAIN[:50])
    other = make_vision_splits(50, 0, seed=12, tasks=VISION_TASKS)[0]
    assert [p.images for p in other] != [p.images for p in TRAIN[:50]]


def test_prompts_have_one_placeholder_one_decodable_image_and_the_record_fields():
    for split, items in (("train", TRAIN), ("eval", HELD_OUT)):
        for i, item in enumerate(items):
            task = item.data_source.removeprefix("vision/")
            assert item.id == f"{split}/{i:06d}" and task in VISION_TASKS and item.modality == "image"
            assert item.prompt.count(IMAGE_TOKEN) == 1 and item.prompt.startswith(IMAGE_TOKEN)
            assert len(item.images) == 1 and item.images[0].startswith(b"\x89PNG")
            assert item.ground_truth in ANSWERS[task] and item.difficulty is not None
    with Image.open(io.BytesIO(TRAIN[0].images[0])) as image:
        assert image.size == (64, 64) and image.mode == "RGB"
    small = make_vision_splits(3, 0, seed=0, tasks=["count"], image_size=32)[0]
    assert all(_pixels(p).shape == (32, 32, 3) for p in small)


def test_answers_match_the_drawn_pixels():
    for item in TRAIN + HELD_OUT:
        pixels = _pixels(item)
        if item.data_source == "vision/count":
            colour = item.prompt.removeprefix(f"{IMAGE_TOKEN}count ").removesuffix(":")
            cells = _cell_colours(pixels)
            assert str(cells[colour]) == item.ground_truth
            assert item.difficulty == sum(cells.values())
        elif item.data_source == "vision/most":
            counts = _cell_colours(pixels)
            assert 2 <= len(counts) <= 3 and len(set(counts.values())) == len(counts), "counts must be distinct"
            assert max(counts, key=counts.__getitem__) == item.ground_truth
        else:
            heights = _bar_heights(pixels)
            assert len(set(heights)) == GRID and all(h > 0 for h in heights)
            assert str(heights.index(max(heights)) + 1) == item.ground_truth
            assert 0 < item.difficulty < 1


def test_every_answer_class_is_about_equally_frequent():
    by_task: dict[str, Counter] = {}
    for item in TRAIN:
        by_task.setdefault(item.data_source, Counter())[item.ground_truth] += 1
    assert set(by_task) == {f"vision/{t}" for t in VISION_TASKS}
    for source, counts in by_task.items():
        task = source.removeprefix("vision/")
        assert set(counts) == set(ANSWERS[task]), f"{task}: classes {sorted(counts)}"
        expected = sum(counts.values()) / len(ANSWERS[task])
        assert all(abs(n - expected) < 0.3 * expected for n in counts.values()), f"{task}: {counts}"


def test_task_weights_and_bad_arguments():
    only = make_vision_splits(200, 0, seed=0, tasks=["tallest", "count"], task_weights=[1.0, 0.0])[0]
    assert {p.data_source for p in only} == {"vision/tallest"}
    with pytest.raises(ValueError, match=r"name each task once, from \['count', 'tallest', 'most'\]"):
        make_vision_splits(1, 1, seed=0, tasks=["count", "colour"])
    with pytest.raises(ValueError, match="name each task once"):
        make_vision_splits(1, 1, seed=0, tasks=[])
    with pytest.raises(ValueError, match="one weight >= 0 per task"):
        make_vision_splits(1, 1, seed=0, tasks=["count"], task_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="counts >= 0"):
        make_vision_splits(-1, 1, seed=0, tasks=["count"])
    with pytest.raises(ValueError, match="at least 16 px"):
        make_vision_splits(1, 1, seed=0, tasks=["count"], image_size=8)


def test_demonstrations_are_wrong_at_the_error_rate_with_another_valid_answer():
    rng = random.Random(0)
    answers = [(item, demonstration(item, rng, 0.3)) for item in TRAIN]
    wrong = [(item, answer) for item, answer in answers if answer != item.ground_truth]
    # 1500 draws at p = 0.3: the standard deviation of the rate is 0.012.
    assert abs(len(wrong) / len(answers) - 0.3) < 0.05
    assert all(answer in ANSWERS[item.data_source.removeprefix("vision/")] for item, answer in answers)
    # A wrong answer is uniform over the task's other answers.
    tallest = Counter(answer for item, answer in wrong if item.data_source == "vision/tallest"
                      and item.ground_truth == "1")
    assert set(tallest) == {"2", "3", "4"}
    assert all(demonstration(item, rng, 1.0) != item.ground_truth for item in TRAIN[:200])
    assert all(demonstration(item, rng, 0.0) == item.ground_truth for item in TRAIN[:200])
    with pytest.raises(ValueError, match=r"is a probability"):
        demonstration(TRAIN[0], rng, 1.5)
    with pytest.raises(ValueError, match="not a vision task"):
        demonstration(TRAIN[0].__class__(id="x", prompt="2+2=", ground_truth="4"), rng, 0.5)


def test_the_alphabet_covers_every_prompt_and_answer_character_once():
    assert len(set(ALPHABET)) == len(ALPHABET)
    used = {c for item in TRAIN for c in item.prompt.replace(IMAGE_TOKEN, "") + item.ground_truth}
    assert used == set(ALPHABET)  # nothing missing, nothing unused


def test_two_thousand_images_take_under_a_second():
    start = time.perf_counter()
    make_vision_splits(2000, 0, seed=5, tasks=VISION_TASKS)
    # Under a second on an idle core; the bound leaves room for a busy machine.
    assert time.perf_counter() - start < 3.0
