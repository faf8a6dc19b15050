"""Synthetic visual tasks: pictures drawn with PIL, one question each, answered by an exact string.

Made for the tiny vision-language model trained on CPU, whose encoder sees a 64x64 image as 8x8 patches merged
2x2 into 16 tokens: one token per 16x16 cell of a 4x4 grid. Every shape fills one cell in one solid colour on a
white ground, so each image token sees whole shapes and nothing needs finer sight than a cell:

    count    shapes (square, circle, triangle) of red, green, blue, 0-4 of each, in distinct cells
             "<image>count red:"  ->  "2"
    tallest  four bars of different heights in four columns
             "<image>tallest:"    ->  "3"      (1-4, left to right)
    most     2-3 colours with different counts (1-4) of shapes
             "<image>most:"       ->  "green"

Each answer class is about equally frequent (the asked colour's count is uniform in 0-4, the tallest bar's
column uniform in 1-4, the winning colour uniform), so a model cannot score by guessing one class.
`Prompt.difficulty`: count and most, the number of shapes in the picture; tallest, the runner-up's height over the
tallest's (closer to 1, harder to tell apart). Images are PNG bytes, a pure function of (seed, split, index):
the held-out split draws from its own random stream, so a different seed or split gives other pictures.
Warm-start answers (`demonstration`) are another of the task's answers with a given probability, so the warm
start reads the image only in part and RL has something to fix. This module knows nothing about tokenizers.
"""

from __future__ import annotations

import io
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flashreinforce.models.image_tokens import IMAGE_TOKEN
from flashreinforce.types import Prompt

VISION_TASKS: tuple[str, ...] = ("count", "tallest", "most")
COLOURS: Mapping[str, tuple[int, int, int]] = {"red": (255, 0, 0), "green": (0, 170, 0), "blue": (0, 0, 255)}
"""Pure, far-apart colours; PIL draws without anti-aliasing, so a drawn pixel is exactly one of these."""
BACKGROUND = (255, 255, 255)
KINDS: tuple[str, ...] = ("square", "circle", "triangle")
GRID = 4
"""Cells a side: a 64x64 image has 16x16 cells, one image token each."""
HEIGHT_UNITS = 16
"""Bar heights are whole units of image_size / 16 (4 px at 64), from MIN_HEIGHT to HEIGHT_UNITS - 1 units."""
MIN_HEIGHT = 2
MIN_GAP = 2
"""The tallest bar beats the runner-up by at least this many units (8 px at 64: one patch row)."""
MAX_COUNT = 4
ANSWERS: Mapping[str, tuple[str, ...]] = {
    "count": tuple(str(n) for n in range(MAX_COUNT + 1)),
    "tallest": tuple(str(n) for n in range(1, GRID + 1)),
    "most": tuple(COLOURS),
}
"""Every answer a task can have: the classes a wrong demonstration picks from."""
QUESTIONS: Mapping[str, tuple[str, ...]] = {
    "count": tuple(f"count {colour}:" for colour in COLOURS),
    "tallest": ("tallest:",),
    "most": ("most:",),
}
"""The text after the image token, per task."""
ALPHABET: str = "".join(sorted({c for texts in (*QUESTIONS.values(), *ANSWERS.values()) for t in texts for c in t}))
"""Every character of a prompt's text (besides IMAGE_TOKEN) or an answer, each once."""
DATA_SOURCE = "vision"


@dataclass(frozen=True)
class Shape:
    cell: int
    """Row-major index in the GRID x GRID grid."""
    colour: str
    kind: str


@dataclass(frozen=True)
class Scene:
    """What one picture shows and what is asked about it: the record the image and the answer both come from."""

    task: str
    question: str
    """The prompt text after IMAGE_TOKEN."""
    answer: str
    difficulty: float
    shapes: tuple[Shape, ...] = ()
    bars: tuple[int, ...] = ()
    """tallest: bar heights in units of image_size / HEIGHT_UNITS, left to right."""
    bar_colour: str = "blue"


def _check_tasks(tasks: Sequence[str], task_weights: Sequence[float] | None) -> list[float]:
    """The weights of `tasks` (equal when None), or a ValueError that says what to give instead."""
    unknown = [t for t in tasks if t not in VISION_TASKS]
    if unknown or not tasks or len(set(tasks)) != len(tasks):
        raise ValueError(f"data.vision.tasks={list(tasks)}: name each task once, from {list(VISION_TASKS)}")
    weights = [1.0] * len(tasks) if task_weights is None else [float(w) for w in task_weights]
    if len(weights) != len(tasks) or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"data.vision.task_weights={task_weights}: give one weight >= 0 per task of {list(tasks)}, "
                         "not all zero")
    return weights


def sample_scene(task: str, rng: random.Random) -> Scene:
    """One random scene of `task`, every answer class about equally likely."""
    if task == "tallest":
        while True:  # rejection keeps the tallest column uniform; about half the draws pass
            bars = tuple(rng.sample(range(MIN_HEIGHT, HEIGHT_UNITS), GRID))
            *_, second, top = sorted(bars)
            if top - second >= MIN_GAP:
                return Scene(task, "tallest:", str(bars.index(top) + 1), round(second / top, 3), bars=bars,
                             bar_colour=rng.choice(tuple(COLOURS)))
    if task == "count":
        counts = {colour: rng.randint(0, MAX_COUNT) for colour in COLOURS}
        asked = rng.choice(tuple(COLOURS))
        question, answer = f"count {asked}:", str(counts[asked])
    elif task == "most":
        colours = rng.sample(tuple(COLOURS), rng.choice((2, 3)))
        counts = dict(zip(colours, rng.sample(range(1, MAX_COUNT + 1), len(colours))))  # distinct: one winner
        question, answer = "most:", max(counts, key=counts.__getitem__)
    else:
        raise ValueError(f"vision task {task!r}: use one of {list(VISION_TASKS)}")
    colours = [colour for colour, n in counts.items() for _ in range(n)]
    cells = rng.sample(range(GRID * GRID), len(colours))
    shapes = tuple(Shape(cell, colour, rng.choice(KINDS)) for cell, colour in zip(cells, colours))
    return Scene(task, question, answer, float(len(shapes)), shapes=shapes)


def draw_scene(scene: Scene, image_size: int = 64) -> bytes:
    """The scene as PNG bytes, image_size x image_size RGB."""
    from PIL import Image, ImageDraw

    if image_size < 16:
        raise ValueError(f"image_size={image_size}: use at least 16 px (4 px cells)")
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    cell = image_size // GRID
    inset = max(1, cell // 8)  # a white gap keeps neighbouring shapes apart
    for shape in scene.shapes:
        x0, y0 = (shape.cell % GRID) * cell + inset, (shape.cell // GRID) * cell + inset
        x1, y1 = x0 + cell - 2 * inset - 1, y0 + cell - 2 * inset - 1
        fill = COLOURS[shape.colour]
        if shape.kind == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        elif shape.kind == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon(((x0 + x1) / 2, y0, x1, y1, x0, y1), fill=fill)
    unit = image_size / HEIGHT_UNITS
    for column, height in enumerate(scene.bars):
        x0 = column * cell + inset
        draw.rectangle((x0, image_size - round(height * unit), x0 + cell - 2 * inset - 1, image_size - 1),
                       fill=COLOURS[scene.bar_colour])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _prompts(split: str, n: int, seed: int, tasks: Sequence[str], weights: Sequence[float],
             image_size: int) -> list[Prompt]:
    # The split name is part of the seed: the held-out pictures come from a stream of their own, and item i of a
    # split does not depend on how many items the other split has.
    rng = random.Random(f"{DATA_SOURCE}/{seed}/{split}")
    items = []
    for i in range(n):
        scene = sample_scene(rng.choices(tasks, weights=weights)[0], rng)
        items.append(Prompt(id=f"{split}/{i:06d}", prompt=f"{IMAGE_TOKEN}{scene.question}", ground_truth=scene.answer,
                            data_source=f"{DATA_SOURCE}/{scene.task}", modality="image",
                            difficulty=scene.difficulty, images=(draw_scene(scene, image_size),)))
    return items


def make_vision_splits(
    num_train: int,
    num_eval: int,
    *,
    seed: int,
    tasks: Sequence[str],
    image_size: int = 64,
    task_weights: Sequence[float] | None = None,
) -> tuple[list[Prompt], list[Prompt]]:
    """Train and held-out prompts, one picture and one question each, deterministic from (seed, split).

    task_weights[k] is the share of tasks[k] (equal when None). Ids: "train/000042", "eval/000007"; data_source
    "vision/<task>", so evaluation reports per task. The splits are independent draws, not disjoint: a task with few
    distinct pictures (tallest has 51,480) can repeat one (2 of the recipe's 256 held-out pictures are in its 6000
    training pictures)."""
    if num_train < 0 or num_eval < 0:
        raise ValueError(f"data.vision: num_train={num_train}, num_eval={num_eval}; use counts >= 0")
    weights = _check_tasks(tasks, task_weights)
    if image_size < 16:
        raise ValueError(f"data.vision.image_size={image_size}: use at least 16 px (4 px cells)")
    tasks = list(tasks)
    return (_prompts("train", num_train, seed, tasks, weights, image_size),
            _prompts("eval", num_eval, seed, tasks, weights, image_size))


def task_of(item: Prompt) -> str:
    """The vision task of an item, from its data_source "vision/<task>"."""
    prefix, _, task = item.data_source.partition("/")
    if prefix != DATA_SOURCE or task not in VISION_TASKS:
        raise ValueError(f"prompt {item.id}: data_source {item.data_source!r} is not a vision task; expected "
                         f"'vision/<task>' with a task of {list(VISION_TASKS)}")
    return task


def demonstration(item: Prompt, rng: random.Random, error_rate: float) -> str:
    """A warm-start answer: the ground truth, or with probability error_rate another answer of the item's task,
    uniformly (a count of 0-4, a column of 1-4, a colour), never the right one."""
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"error_rate={error_rate} (sft.answer_error_rate) is a probability: use a value in [0, 1]")
    answers = ANSWERS[task_of(item)]
    if item.ground_truth not in answers:
        raise ValueError(f"prompt {item.id}: ground truth {item.ground_truth!r} is not an answer of its task "
                         f"({list(answers)})")
    # One draw whatever the rate, so a seed's stream does not depend on it until an answer goes wrong.
    if rng.random() >= error_rate:
        return item.ground_truth
    return rng.choice([a for a in answers if a != item.ground_truth])
