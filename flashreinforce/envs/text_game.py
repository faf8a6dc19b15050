"""A small built-in text game: rooms on a grid, locked doors, coloured keys, a goal room to reach.

Built for a tiny character-level model: terse, regular text over TEXT_GAME_ALPHABET. A layout is a pure
function of (layout seed, LayoutOptions), named by the prompt's ground truth, so held-out prompts are
held-out layouts; an episode is a pure function of (layout, actions) and ignores the episode seed.
Each room signposts its exits: an exit line lists the rooms and the keys that lie beyond it, so a good
policy reads the observation (the goal's exit differs per layout) instead of memorising layouts.

    prompt       find the garden.
    observation  room: hall. items: coin.
                 n: den, red key.
                 e(red): yard, garden.
                 actions: go n|take coin

The oracle (`solve`, breadth-first over game states) and `noisy_expert_trace` make SFT warm-start data.
This module knows nothing about tokenizers or the episode runner.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from flashreinforce.envs.protocol import StepResult
from flashreinforce.envs.traces import ExpertTrace, Turn
from flashreinforce.types import Prompt

TEXT_GAME_ALPHABET = "abcdefghijklmnopqrstuvwxyz :,.|()\n"
"""Every character of the game's prompts, observations and admissible actions."""
DATA_SOURCE = "text_game"
ROOM_NAMES = ("hall", "den", "attic", "yard", "cellar", "study", "garden", "kitchen", "lab", "porch",
              "shed", "vault", "bath", "loft", "tower", "cave")
KEY_COLORS = ("red", "blue", "green")
DISTRACTORS = ("coin", "lamp", "book", "rope")
DIRECTIONS = ("n", "e", "s", "w")
_STEP = {"n": (0, 1), "e": (1, 0), "s": (0, -1), "w": (-1, 0)}
_OPPOSITE = {"n": "s", "e": "w", "s": "n", "w": "e"}
SPLITS = ("train", "eval")
EVAL_SHARE = 64
"""A layout is held out when the first byte of its content hash is below this (a quarter of all layouts)."""
_MAX_ATTEMPTS = 2000
INVALID = "invalid action."
OUT_OF_STEPS = "out of steps."


@dataclass(frozen=True)
class LayoutOptions:
    """Difficulty knobs of a layout; the prompt's ground truth records them with the layout seed."""

    rooms: int = 4
    """Rooms on the grid, 2 to 8, connected as a tree (one route between any two rooms)."""
    locked_doors: int = 1
    """Locked doors on the route from the start to the goal, each opened by its own coloured key (0 to 3)."""
    distractors: int = 1
    """Useless items (coin, lamp, ...) that can be taken, wasting a step (0 to 4)."""
    max_solution: int = 6
    """Layouts whose optimal solution is longer are redrawn; every solution takes at least 2 actions."""

    def __post_init__(self) -> None:
        problems = []
        if not (isinstance(self.rooms, int) and 2 <= self.rooms <= 8):
            problems.append(f"rooms={self.rooms!r} must be an int in [2, 8]")
        elif not (isinstance(self.locked_doors, int) and 0 <= self.locked_doors <= min(3, self.rooms - 1)):
            problems.append(f"locked_doors={self.locked_doors!r} must be an int in [0, {min(3, self.rooms - 1)}] "
                            f"(at most 3 key colours, fewer than rooms={self.rooms})")
        if not (isinstance(self.distractors, int) and 0 <= self.distractors <= len(DISTRACTORS)):
            problems.append(f"distractors={self.distractors!r} must be an int in [0, {len(DISTRACTORS)}]")
        if not (isinstance(self.max_solution, int) and 2 <= self.max_solution <= 30):
            problems.append(f"max_solution={self.max_solution!r} must be an int in [2, 30]")
        if problems:
            raise ValueError("invalid text game LayoutOptions: " + "; ".join(problems))


@dataclass(frozen=True)
class Door:
    """A door between rooms `a` and `b`; `direction` leads from a to b. `lock` is a key colour or ""."""

    a: str
    b: str
    direction: str
    lock: str = ""


@dataclass(frozen=True)
class Layout:
    rooms: tuple[str, ...]
    """rooms[0] is where every episode starts."""
    doors: tuple[Door, ...]
    items: tuple[tuple[str, str], ...]
    """(item, room it lies in), sorted by item."""
    goal: str

    @property
    def start(self) -> str:
        return self.rooms[0]


@dataclass(frozen=True)
class GameState:
    room: str
    inventory: frozenset[str] = frozenset()
    unlocked: frozenset[int] = frozenset()
    """Indices into Layout.doors of the locked doors opened so far (they stay open)."""


class Exit(NamedTuple):
    direction: str
    room: str
    door: int


# ---------------------------------------------------------------- layouts


@functools.lru_cache(maxsize=4096)
def make_layout(seed: int, options: LayoutOptions = LayoutOptions()) -> Layout:
    """The layout of `seed`: a random tree of rooms on a grid, then locks, keys and items; redrawn (from the
    same random stream, so still a pure function of the seed) until its optimal solution fits the options."""
    rng = random.Random(seed)
    for _ in range(_MAX_ATTEMPTS):
        rooms, doors = _grow_rooms(rng, options.rooms)
        layout = _furnish(rng, rooms, doors, options)
        if layout is not None:
            solution = _shortest(layout, initial_state(layout))
            if solution is not None and 2 <= len(solution) <= options.max_solution:
                return layout
    raise ValueError(f"{options} gave no layout solvable in 2 to max_solution={options.max_solution} actions in "
                     f"{_MAX_ATTEMPTS} draws: raise max_solution or lower rooms / locked_doors")


def _grow_rooms(rng: random.Random, count: int) -> tuple[tuple[str, ...], list[Door]]:
    # Each new room hangs off a random placed room through a free neighbouring cell, so directions are
    # consistent (n then s returns) and rooms form a tree: the signposts below are then well defined.
    names = rng.sample(ROOM_NAMES, count)
    cells = {names[0]: (0, 0)}
    doors = []
    for name in names[1:]:
        while True:
            parent, direction = rng.choice(list(cells)), rng.choice(DIRECTIONS)
            x, y = cells[parent]
            cell = (x + _STEP[direction][0], y + _STEP[direction][1])
            if cell not in cells.values():
                break
        cells[name] = cell
        doors.append(Door(parent, name, direction))
    return tuple(names), doors


def _furnish(rng: random.Random, rooms: tuple[str, ...], doors: list[Door],
             options: LayoutOptions) -> Layout | None:
    """Goal, locks on the start-goal route, one key per lock on the start's side of it, distractors."""
    goal = rng.choice(rooms[1:])
    route = _route(doors, rooms[0], goal)
    if len(route) < options.locked_doors:
        return None
    locked = sorted(rng.sample(route, options.locked_doors), key=route.index)
    colors = rng.sample(KEY_COLORS, options.locked_doors)
    doors = [dataclasses.replace(d, lock=colors[locked.index(i)]) if i in locked else d for i, d in enumerate(doors)]
    items = []
    for index, color in zip(locked, colors):
        # Keys of later locks may lie past earlier ones: still reachable, since those keys come first.
        near_side = _reachable(doors, rooms[0], cut=index)
        items.append((f"{color} key", rng.choice(near_side)))
    items += [(name, rng.choice(rooms)) for name in rng.sample(DISTRACTORS, options.distractors)]
    return Layout(rooms, tuple(doors), tuple(sorted(items)), goal)


def _neighbours(doors: Sequence[Door], room: str) -> list[Exit]:
    found = []
    for index, door in enumerate(doors):
        if door.a == room:
            found.append(Exit(door.direction, door.b, index))
        elif door.b == room:
            found.append(Exit(_OPPOSITE[door.direction], door.a, index))
    return sorted(found, key=lambda e: DIRECTIONS.index(e.direction))


def _reachable(doors: Sequence[Door], start: str, cut: int = -1) -> list[str]:
    """Rooms reachable from `start` without crossing door `cut`, nearest first."""
    seen, queue = [start], deque([start])
    while queue:
        for _, room, door in _neighbours(doors, queue.popleft()):
            if door != cut and room not in seen:
                seen.append(room)
                queue.append(room)
    return seen


def _route(doors: Sequence[Door], start: str, goal: str) -> list[int]:
    """Door indices on the tree's one route from start to goal, in walking order."""
    previous: dict[str, tuple[str, int] | None] = {start: None}
    queue = deque([start])
    while queue:
        room = queue.popleft()
        for _, nxt, door in _neighbours(doors, room):
            if nxt not in previous:
                previous[nxt] = (room, door)
                queue.append(nxt)
    route, room = [], goal
    while previous[room] is not None:
        room, door = previous[room]
        route.append(door)
    return route[::-1]


def layout_signature(layout: Layout) -> str:
    """A content hash that ignores how the layout was drawn: equal games, equal signatures."""
    doors = sorted((d.a, d.b, d.direction, d.lock) if d.a < d.b else (d.b, d.a, _OPPOSITE[d.direction], d.lock)
                   for d in layout.doors)
    content = repr((layout.start, layout.goal, doors, sorted(layout.items)))
    return hashlib.sha256(content.encode()).hexdigest()


# ---------------------------------------------------------------- rules


def initial_state(layout: Layout) -> GameState:
    return GameState(layout.start)


def _items_here(layout: Layout, state: GameState) -> list[str]:
    return [item for item, room in layout.items if room == state.room and item not in state.inventory]


def _is_open(layout: Layout, state: GameState, door: int) -> bool:
    return not layout.doors[door].lock or door in state.unlocked


def admissible_actions(layout: Layout, state: GameState) -> tuple[str, ...]:
    """The actions that change something, in a fixed order: go (n, e, s, w), unlock, take."""
    exits = _neighbours(layout.doors, state.room)
    moves = [f"go {e.direction}" for e in exits if _is_open(layout, state, e.door)]
    unlocks = [f"unlock {e.direction}" for e in exits
               if not _is_open(layout, state, e.door) and f"{layout.doors[e.door].lock} key" in state.inventory]
    takes = [f"take {item}" for item in _items_here(layout, state)]
    return (*moves, *unlocks, *takes)


def apply_action(layout: Layout, state: GameState, action: str) -> GameState | None:
    """The state after `action`, or None when it is not admissible (the episode then only loses a step)."""
    if action not in admissible_actions(layout, state):
        return None
    verb, _, target = action.partition(" ")
    if verb == "take":
        return dataclasses.replace(state, inventory=state.inventory | {target})
    exit_ = next(e for e in _neighbours(layout.doors, state.room) if e.direction == target)
    if verb == "unlock":
        return dataclasses.replace(state, unlocked=state.unlocked | {exit_.door})
    return dataclasses.replace(state, room=exit_.room)


def describe(layout: Layout, state: GameState) -> str:
    """The room line, one signpost line per exit (rooms then keys beyond it), and the admissible actions."""
    line = f"room: {state.room}."
    if items := _items_here(layout, state):
        line += f" items: {', '.join(items)}."
    if state.inventory:
        line += f" inv: {', '.join(sorted(state.inventory))}."
    lines = [line]
    for direction, room, door in _neighbours(layout.doors, state.room):
        beyond = _reachable(layout.doors, room, cut=door)
        keys = [item for item, where in layout.items
                if item.endswith(" key") and where in beyond and item not in state.inventory]
        lock = "" if _is_open(layout, state, door) else f"({layout.doors[door].lock})"
        lines.append(f"{direction}{lock}: {', '.join([*beyond, *keys])}.")
    lines.append(f"actions: {'|'.join(admissible_actions(layout, state))}")
    return "\n".join(lines)


def play_turn(layout: Layout, state: GameState, action: str, turn: int, max_steps: int
              ) -> tuple[GameState, StepResult]:
    """Turn number `turn` (1-based) of an episode: the pure step shared by the env and the expert traces."""
    nxt = apply_action(layout, state, action)
    if nxt is not None and nxt.room == layout.goal:
        return nxt, StepResult(f"room: {nxt.room}. goal reached.", 1.0, True, {"success": True, "invalid": False})
    invalid = nxt is None
    nxt = state if invalid else nxt
    if turn >= max_steps:
        return nxt, StepResult(OUT_OF_STEPS, 0.0, True, {"success": False, "invalid": invalid})
    observation = describe(layout, nxt)
    return nxt, StepResult(f"{INVALID}\n{observation}" if invalid else observation, 0.0, False,
                           {"success": False, "invalid": invalid})


def parse_action(text: str) -> str:
    """The model's turn as an action: whitespace stripped, first line only."""
    lines = text.strip().splitlines()
    return lines[0].strip() if lines else ""


# ---------------------------------------------------------------- oracle and demonstrations


def _shortest(layout: Layout, state: GameState) -> list[str] | None:
    if state.room == layout.goal:
        return []
    parents: dict[GameState, tuple[GameState, str] | None] = {state: None}
    queue = deque([state])
    while queue:
        current = queue.popleft()
        for action in admissible_actions(layout, current):
            nxt = apply_action(layout, current, action)
            if nxt in parents:
                continue
            parents[nxt] = (current, action)
            if nxt.room == layout.goal:
                actions = []
                while parents[nxt] is not None:
                    nxt, action = parents[nxt]
                    actions.append(action)
                return actions[::-1]
            queue.append(nxt)
    return None


def solve(layout: Layout, state: GameState | None = None) -> list[str]:
    """An optimal action sequence from `state` (default: the start); breadth-first, ties in action order."""
    solution = _shortest(layout, initial_state(layout) if state is None else state)
    # Nothing is ever lost (keys stay, doors stay open), so every state of a generated layout is solvable.
    assert solution is not None, f"layout {layout} has no solution from {state}"
    return solution


def _wrong_action(layout: Layout, state: GameState, best: str, rng: random.Random) -> str:
    """Another admissible action, or a move through a wall (an inadmissible one)."""
    walls = [f"go {d}" for d in DIRECTIONS if d not in {e.direction for e in _neighbours(layout.doors, state.room)}]
    options = [a for a in admissible_actions(layout, state) if a != best] + walls[:1]
    return rng.choice(options) if options else best


def noisy_expert_trace(layout: Layout, rng: random.Random, error_rate: float, *, max_steps: int = 8) -> ExpertTrace:
    """An imperfect demonstration: each turn plays a wrong action with probability `error_rate`, else the
    oracle's next action from wherever the episode now stands (so it recovers), until the goal or max_steps."""
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"error_rate={error_rate} is a probability: use a value in [0, 1]")
    state, observation, turns = initial_state(layout), describe(layout, initial_state(layout)), []
    for turn in range(1, max_steps + 1):
        best = solve(layout, state)[0]
        # One draw per turn whatever the outcome, so a seed's stream does not depend on the layout.
        wrong = rng.random() < error_rate
        action = _wrong_action(layout, state, best, rng) if wrong else best
        turns.append(Turn(observation, action))
        state, result = play_turn(layout, state, action, turn, max_steps)
        observation = result.observation
        if result.done:
            return ExpertTrace(tuple(turns), observation, bool(result.info["success"]))
    raise AssertionError(f"max_steps={max_steps} turns should have ended the episode")


# ---------------------------------------------------------------- prompts


def layout_spec(seed: int, options: LayoutOptions) -> str:
    """The ground truth naming a layout: `layout:123 rooms:4 locked:1 distractors:1 max_solution:6`."""
    return (f"layout:{seed} rooms:{options.rooms} locked:{options.locked_doors} "
            f"distractors:{options.distractors} max_solution:{options.max_solution}")


_SPEC_FIELDS = {"rooms": "rooms", "locked": "locked_doors", "distractors": "distractors",
                "max_solution": "max_solution"}


def parse_layout_spec(text: str) -> tuple[int, LayoutOptions]:
    """(seed, options) of a ground truth written by `layout_spec`; missing knobs take LayoutOptions' defaults."""
    fields = {}
    for part in text.split():
        key, _, value = part.partition(":")
        if key != "layout" and key not in _SPEC_FIELDS:
            raise ValueError(f"text game ground truth {text!r}: unknown field {key!r}; write "
                             "'layout:<seed>' optionally with rooms:, locked:, distractors:, max_solution:")
        if not value.lstrip("-").isdigit():
            raise ValueError(f"text game ground truth {text!r}: {key} needs an integer, as in {key}:4")
        fields[key] = int(value)
    if "layout" not in fields:
        raise ValueError(f"text game ground truth {text!r} names no layout: write e.g. 'layout:123 rooms:4'")
    seed = fields.pop("layout")
    return seed, LayoutOptions(**{_SPEC_FIELDS[k]: v for k, v in fields.items()})


def layout_of(prompt: Prompt) -> Layout:
    """The layout a text game prompt plays."""
    return make_layout(*parse_layout_spec(prompt.ground_truth))


def layout_split(layout: Layout) -> str:
    """Which split a layout belongs to, by content hash: train and eval can never share a layout."""
    return "eval" if int(layout_signature(layout)[:2], 16) < EVAL_SHARE else "train"


def text_game_prompts(n: int, *, split: str, seed: int, **layout_options: int) -> list[Prompt]:
    """`n` distinct layouts of `split` ("train" | "eval"), deterministic from `seed`.

    The split is a function of each layout's content (layout_split), so the splits are disjoint whatever the
    seeds and calls. Prompt: `find the garden.`; ground_truth: layout_spec(...); difficulty: the optimal
    solution's length; id: `text_game/train/r4-l1-d1-m6/<layout seed>`.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use one of {SPLITS}")
    if n < 0:
        raise ValueError(f"n={n}: use a count >= 0")
    try:
        options = LayoutOptions(**layout_options)
    except TypeError as error:
        raise ValueError(f"text_game_prompts: {error}; the layout options are "
                         f"{[f.name for f in dataclasses.fields(LayoutOptions)]}") from error
    tag = f"r{options.rooms}-l{options.locked_doors}-d{options.distractors}-m{options.max_solution}"
    rng, prompts, seen = random.Random(f"{DATA_SOURCE}/{split}/{seed}"), [], set()
    for _ in range(20 * n + 1000):
        if len(prompts) == n:
            return prompts
        layout_seed = rng.randrange(2**31)
        layout = make_layout(layout_seed, options)
        signature = layout_signature(layout)
        if layout_split(layout) != split or signature in seen:
            continue
        seen.add(signature)
        prompts.append(Prompt(id=f"{DATA_SOURCE}/{split}/{tag}/{layout_seed}", prompt=f"find the {layout.goal}.",
                              ground_truth=layout_spec(layout_seed, options), data_source=DATA_SOURCE,
                              difficulty=float(len(solve(layout)))))
    if len(prompts) == n:
        return prompts
    raise ValueError(f"found only {len(prompts)} distinct {split} layouts for {options}; ask for fewer or "
                     "raise rooms / distractors for a larger space of layouts")


# ---------------------------------------------------------------- the environment


class TextGameEnv:
    """The Env of the text game. Options: `max_steps` (turns before the episode ends unsuccessfully).

    The layout comes from `prompt.ground_truth` (layout_spec); the episode seed is unused, since nothing in an
    episode is random. Reward 1.0 and info success=True on reaching the goal; 0 otherwise. An inadmissible or
    unparseable action costs a turn and the observation starts with `invalid action.`.
    """

    def __init__(self, max_steps: int = 8) -> None:
        if not (isinstance(max_steps, int) and max_steps >= 1):
            raise ValueError(f"text_game max_steps={max_steps!r} must be an int >= 1, e.g. 8")
        self.max_steps = max_steps
        self._layout: Layout | None = None
        self._state: GameState | None = None
        self._turn = 0
        self._done = False

    def reset(self, prompt: Prompt, seed: int) -> str:
        try:
            self._layout = layout_of(prompt)
        except ValueError as error:
            raise ValueError(f"prompt {prompt.id}: {error}") from error
        self._state, self._turn, self._done = initial_state(self._layout), 0, False
        return describe(self._layout, self._state)

    def step(self, action: str) -> StepResult:
        assert self._layout is not None and not self._done, "step() needs a reset() and an episode not yet done"
        self._turn += 1
        self._state, result = play_turn(self._layout, self._state, parse_action(action), self._turn, self.max_steps)
        self._done = result.done
        return result

    def close(self) -> None:
        self._layout = self._state = None
