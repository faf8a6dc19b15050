"""A small visual grid world: an agent that must look at a picture to know where to go.

A size x size grid drawn with PIL: the agent a red square, the goal a green one, on white. Each turn the model
answers a move in words (up, down, left, right) and sees the new picture; reward 1 when the agent reaches the
goal within max_steps turns, else 0. The prompt only says what to do, so the positions are in the pictures alone:

    prompt       reach the goal.
    observation  <image>move:            (one picture; "wall." before it when the move hit the edge)
    action       left

At the default 4x4 grid on a 64x64 picture each cell is 16x16 pixels: one image token of the tiny vision encoder
(8x8 patches merged 2x2) sees one whole cell. A layout is a pure function of (layout seed, size), named by the
prompt's ground truth, so held-out prompts are held-out layouts (split by content hash); an episode is a pure
function of (layout, actions) and ignores the episode seed. The oracle (`solve`) and `noisy_expert_trace` make
SFT warm-start data. This module knows nothing about tokenizers or the episode runner.
"""

from __future__ import annotations

import functools
import hashlib
import io
import random
from dataclasses import dataclass

from flashreinforce.envs.protocol import ImageObservation, StepResult
from flashreinforce.envs.traces import ExpertTrace, Turn
from flashreinforce.types import IMAGE_TOKEN, Prompt

DATA_SOURCE = "visual_grid"
MOVES: dict[str, tuple[int, int]] = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}
"""Each move's (column, row) step; row 0 is the top of the picture."""
AGENT, GOAL, BACKGROUND = (255, 0, 0), (0, 170, 0), (255, 255, 255)
"""Pure, far-apart colours; PIL draws rectangles without anti-aliasing, so every pixel is exactly one of them."""
PROMPT = "reach the goal."
LOOK = f"{IMAGE_TOKEN}move:"
"""An observation's text: the picture, then the cue to move."""
WALL, INVALID, GOAL_REACHED, OUT_OF_STEPS = "wall.", "invalid move.", "goal reached.", "out of moves."
ALPHABET = "".join(sorted(set(PROMPT + "move:" + WALL + INVALID + GOAL_REACHED + OUT_OF_STEPS + "".join(MOVES) + "\n")))
"""Every character of the prompts, observations (besides IMAGE_TOKEN) and moves."""
SPLITS = ("train", "eval")
EVAL_SHARE = 64
"""A layout is held out when the first byte of its content hash is below this (a quarter of all layouts)."""
MIN_DISTANCE = 2
"""Start and goal are at least two moves apart, so no single answer solves a layout."""

Cell = tuple[int, int]
"""(column, row) of a grid cell."""


@dataclass(frozen=True)
class GridLayout:
    size: int
    start: Cell
    goal: Cell


def _check_size(size: int) -> None:
    if not (isinstance(size, int) and 2 <= size <= 8):
        raise ValueError(f"visual grid size={size!r} must be an int in [2, 8] (cells a side)")


def distance(a: Cell, b: Cell) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


@functools.lru_cache(maxsize=4096)
def make_layout(seed: int, size: int = 4) -> GridLayout:
    """The layout of `seed`: start and goal drawn until they are MIN_DISTANCE moves apart or more."""
    _check_size(size)
    rng = random.Random(seed)
    cells = [(x, y) for y in range(size) for x in range(size)]
    while True:  # at least 2 of every 3 draws pass on a 2x2 grid, more on larger ones
        start, goal = rng.sample(cells, 2)
        if distance(start, goal) >= MIN_DISTANCE:
            return GridLayout(size, start, goal)


def draw_grid(layout: GridLayout, agent: Cell, image_size: int = 64) -> bytes:
    """The picture of `agent` in `layout`, PNG bytes, image_size x image_size RGB. A white inset keeps each
    square inside its cell, so a cell's pixels show one thing."""
    from PIL import Image, ImageDraw  # lazy: the worker imports it only when a picture is drawn

    if image_size < 4 * layout.size:
        raise ValueError(f"image_size={image_size}: use at least 4 px per cell ({4 * layout.size} for size "
                         f"{layout.size})")
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    cell = image_size / layout.size
    inset = max(1, int(cell) // 8)
    for (x, y), colour in ((layout.goal, GOAL), (agent, AGENT)):
        draw.rectangle((round(x * cell) + inset, round(y * cell) + inset,
                        round((x + 1) * cell) - inset - 1, round((y + 1) * cell) - inset - 1), fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# ---------------------------------------------------------------- rules


def parse_move(text: str) -> str:
    """The model's turn as a move: its first line, stripped; "" when that is not one of MOVES."""
    lines = text.strip().splitlines()
    move = lines[0].strip() if lines else ""
    return move if move in MOVES else ""


def look(layout: GridLayout, agent: Cell, image_size: int, note: str = "") -> ImageObservation:
    """What the agent sees: the picture, after a short note when there is one."""
    return ImageObservation(f"{note}\n{LOOK}" if note else LOOK, (draw_grid(layout, agent, image_size),))


def play_turn(layout: GridLayout, agent: Cell, action: str, turn: int, max_steps: int,
              image_size: int) -> tuple[Cell, StepResult]:
    """Turn number `turn` (1-based) of an episode: the pure step shared by the env and the expert traces. A move
    off the grid keeps the agent in place ("wall."); text that is no move costs the turn ("invalid move.")."""
    move = parse_move(action)
    step = MOVES.get(move, (0, 0))
    target = (agent[0] + step[0], agent[1] + step[1])
    wall = bool(move) and not (0 <= target[0] < layout.size and 0 <= target[1] < layout.size)
    nxt = agent if wall or not move else target
    info = {"success": nxt == layout.goal, "invalid": not move}
    if nxt == layout.goal:
        return nxt, StepResult(GOAL_REACHED, 1.0, True, info)
    if turn >= max_steps:
        return nxt, StepResult(OUT_OF_STEPS, 0.0, True, info)
    note = INVALID if not move else WALL if wall else ""
    return nxt, StepResult(look(layout, nxt, image_size, note), 0.0, False, info)


# ---------------------------------------------------------------- oracle and demonstrations


def solve(layout: GridLayout, agent: Cell | None = None) -> list[str]:
    """A shortest sequence of moves from `agent` (default: the start): the horizontal ones, then the vertical."""
    x, y = layout.start if agent is None else agent
    dx, dy = layout.goal[0] - x, layout.goal[1] - y
    return ["right" if dx > 0 else "left"] * abs(dx) + ["down" if dy > 0 else "up"] * abs(dy)


def noisy_expert_trace(layout: GridLayout, rng: random.Random, error_rate: float, *, max_steps: int = 8,
                       image_size: int = 64) -> ExpertTrace:
    """An imperfect demonstration: each turn plays another move with probability `error_rate`, else the oracle's
    next move from wherever the agent now stands (so it recovers), until the goal or max_steps."""
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"error_rate={error_rate} is a probability: use a value in [0, 1]")
    agent, observation, turns = layout.start, look(layout, layout.start, image_size), []
    for turn in range(1, max_steps + 1):
        best = solve(layout, agent)[0]
        # One draw per turn whatever the outcome, so a seed's stream does not depend on the layout.
        wrong = rng.random() < error_rate
        action = rng.choice([m for m in MOVES if m != best]) if wrong else best
        turns.append(Turn(observation, action))
        agent, result = play_turn(layout, agent, action, turn, max_steps, image_size)
        if result.done:
            return ExpertTrace(tuple(turns), result.observation, bool(result.info["success"]))
        observation = result.observation
    raise AssertionError(f"max_steps={max_steps} turns should have ended the episode")


# ---------------------------------------------------------------- prompts


def layout_spec(seed: int, size: int) -> str:
    """The ground truth naming a layout: `layout:123 size:4`."""
    return f"layout:{seed} size:{size}"


def parse_layout_spec(text: str) -> tuple[int, int]:
    """(seed, size) of a ground truth written by `layout_spec`."""
    fields = dict(part.partition(":")[::2] for part in text.split())
    if set(fields) != {"layout", "size"} or not all(v.lstrip("-").isdigit() for v in fields.values()):
        raise ValueError(f"visual grid ground truth {text!r}: write 'layout:<seed> size:<cells a side>', e.g. "
                         "'layout:123 size:4'")
    return int(fields["layout"]), int(fields["size"])


def layout_of(prompt: Prompt) -> GridLayout:
    """The layout a visual grid prompt plays."""
    return make_layout(*parse_layout_spec(prompt.ground_truth))


def layout_split(layout: GridLayout) -> str:
    """Which split a layout belongs to, by content hash: train and eval can never share a layout."""
    digest = hashlib.sha256(repr((layout.size, layout.start, layout.goal)).encode()).hexdigest()
    return "eval" if int(digest[:2], 16) < EVAL_SHARE else "train"


def visual_grid_prompts(n: int, *, split: str, seed: int, size: int = 4) -> list[Prompt]:
    """`n` distinct layouts of `split` ("train" | "eval"), deterministic from `seed`.

    Prompt: `reach the goal.` (no positions: they are in the pictures); ground_truth: layout_spec(...);
    difficulty: the start's distance to the goal; modality "image"; id: `visual_grid/train/s4/<layout seed>`.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use one of {SPLITS}")
    if n < 0:
        raise ValueError(f"n={n}: use a count >= 0")
    _check_size(size)
    rng, prompts, seen = random.Random(f"{DATA_SOURCE}/{split}/{seed}"), [], set()
    for _ in range(20 * n + 1000):
        if len(prompts) == n:
            return prompts
        layout_seed = rng.randrange(2**31)
        layout = make_layout(layout_seed, size)
        if layout_split(layout) != split or layout in seen:
            continue
        seen.add(layout)
        prompts.append(Prompt(id=f"{DATA_SOURCE}/{split}/s{size}/{layout_seed}", prompt=PROMPT,
                              ground_truth=layout_spec(layout_seed, size), data_source=DATA_SOURCE,
                              modality="image", difficulty=float(distance(layout.start, layout.goal))))
    if len(prompts) == n:
        return prompts
    raise ValueError(f"found only {len(prompts)} distinct {split} layouts of a {size}x{size} grid; ask for fewer "
                     "or raise size for more layouts")


# ---------------------------------------------------------------- the environment


class VisualGridEnv:
    """The Env of the visual grid. Options: `max_steps` (turns before the episode ends unsuccessfully) and
    `image_size` (pixels a side of each picture).

    The layout comes from `prompt.ground_truth` (layout_spec); the episode seed is unused. Every observation but
    the last shows the picture (ImageObservation); reward 1.0 and info success=True on reaching the goal.
    """

    def __init__(self, max_steps: int = 8, image_size: int = 64) -> None:
        if not (isinstance(max_steps, int) and max_steps >= 1):
            raise ValueError(f"visual_grid max_steps={max_steps!r} must be an int >= 1, e.g. 8")
        if not (isinstance(image_size, int) and image_size >= 8):
            raise ValueError(f"visual_grid image_size={image_size!r} must be an int >= 8, e.g. 64")
        self.max_steps, self.image_size = max_steps, image_size
        self._layout: GridLayout | None = None
        self._agent: Cell = (0, 0)
        self._turn = 0
        self._done = False

    def reset(self, prompt: Prompt, seed: int) -> ImageObservation:
        try:
            self._layout = layout_of(prompt)
        except ValueError as error:
            raise ValueError(f"prompt {prompt.id}: {error}") from error
        self._agent, self._turn, self._done = self._layout.start, 0, False
        return look(self._layout, self._agent, self.image_size)

    def step(self, action: str) -> StepResult:
        assert self._layout is not None and not self._done, "step() needs a reset() and an episode not yet done"
        self._turn += 1
        self._agent, result = play_turn(self._layout, self._agent, action, self._turn, self.max_steps,
                                        self.image_size)
        self._done = result.done
        return result

    def close(self) -> None:
        self._layout = None
