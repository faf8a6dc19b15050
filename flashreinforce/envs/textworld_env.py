"""TextWorld and ALFWorld games as Envs (optional extras: `pip install textworld`; ALFWorld also needs its data).

One shared core plays any game file TextWorld can start (TextWorldSession): it strips TextWorld's ASCII banner
and padded status lines, offers the admissible commands in every observation, reads `won` / `lost` (TextWorld's
`done` does not tell winning from running out of moves), and can show the task plus the last k steps in each
observation, as common ALFWorld setups do. The two Envs differ only in where games come from and in the reward:
TextWorldEnv pays the difference of TextWorld's cumulative score; ALFWorldEnv pays 10 on winning (the common
setup) and adds ALFWorld's name demangling. textworld and alfworld are imported only when a game starts.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashreinforce.envs.protocol import StepResult
from flashreinforce.types import Prompt

INSTRUCTION = "You are playing a text game. Reply to each observation with one command, on one line."
"""Prompt.prompt of the generated games and of ALFWorld prompts: the task itself comes in the first observation."""
_BANNER_LINE = re.compile(r"^[ _|\\/$<>]*[_|\\/$][ _|\\/$<>]*$")
"""A line drawn only with the characters of TextWorld's ASCII-art banner."""
_STATUS_LINE = re.compile(r"^>.*$", re.MULTILINE)
"""The command prompt, padded with spaces and followed by the room and score: `>      -= Studio =-0/2`."""
_RESTART_LINE = re.compile(r"^Would you like to RESTART.*$", re.MULTILINE)
_ALFWORLD_WELCOME = "-= Welcome to TextWorld, ALFRED! =-"
ALFWORLD_TASK_MARKER = "Your task is to: "
ALFWORLD_SPLITS = ("train", "valid_seen", "valid_unseen")
_ALFWORLD_DOWNLOAD = ("ALFWorld's games are downloaded data: pip install alfworld && alfworld-download, then set "
                      "ALFWORLD_DATA to the folder it filled (it holds json_2.1.1/), or pass data_dir=")


# ---------------------------------------------------------------- pure text handling


def clean_feedback(text: str, *, objective: str = "", drop_lines: Sequence[str] = ()) -> str:
    """Game text without the banner, the status line, the restart question, the objective and `drop_lines`.

    Example: "\\n ___ \\n|   |\\n\\nHey, go east.\\n\\n-= Den =-\\nA den.\\n>      -= Den =-0/1" with objective
    "Hey, go east." gives "-= Den =-\\nA den.".
    """
    if objective:
        text = text.replace(objective, "")
    text = _RESTART_LINE.sub("", _STATUS_LINE.sub("", text))
    lines = [line.strip() for line in text.splitlines()
             if not _BANNER_LINE.match(line) and line.strip() not in drop_lines]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def split_task(feedback: str, marker: str) -> tuple[str, str]:
    """(task, feedback without it) for games that state the task after `marker`, to the end of its line."""
    before, found, after = feedback.partition(marker)
    if not found:
        return "", feedback
    task, _, rest = after.partition("\n")
    return task.strip(), (before + rest).strip()


def render_observation(task: str, current: str, admissible: Sequence[str], *, step: int,
                       history: Sequence[tuple[str, str]] | None) -> str:
    """What the model reads. history None: the task only on the first observation; a list (the last k
    (observation, action) pairs, possibly empty): the task, those steps, then the current observation."""
    commands = [f"Admissible commands: {', '.join(admissible)}."] if admissible else []
    if history is None:
        return "\n".join([*([f"Task: {task}"] if step == 0 and task else []), current, *commands])
    parts = [f"Task: {task}"] if task else []
    if history:
        parts.append(f"Your last {len(history)} of {step} steps:")
        for observation, action in history:
            parts += [f"Observation: {observation}", f"Action: {action}"]
    parts += [f"Step {step + 1}. Current observation: {current}", *commands]
    return "\n".join(parts)


def parse_command(text: str) -> str:
    """The model's turn as a command: whitespace stripped, first line only."""
    lines = text.strip().splitlines()
    return lines[0].strip() if lines else ""


# ---------------------------------------------------------------- the shared core


@dataclass(frozen=True)
class SessionSettings:
    max_steps: int = 50
    """Turns before the episode ends (unsuccessfully, unless the game was won)."""
    history: int | None = None
    """None: plain observations; k >= 0: each observation carries the task and the last k steps."""
    reward: str = "score"
    """"score": the step's change of TextWorld's cumulative score; "won": won_reward on the winning step."""
    won_reward: float = 10.0
    task_marker: str = ""
    """Games that state their task in the text after this marker (ALFWorld); else TextWorld's objective."""
    drop_lines: tuple[str, ...] = ()
    """Exact lines to remove from game text (ALFWorld's welcome line)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.max_steps, int) and self.max_steps >= 1):
            raise ValueError(f"max_steps={self.max_steps!r} must be an int >= 1, e.g. 50")
        if self.history is not None and not (isinstance(self.history, int) and self.history >= 0):
            raise ValueError(f"history={self.history!r} must be None (no history) or an int k >= 0 (last k steps)")
        if self.reward not in ("score", "won"):
            raise ValueError(f"reward={self.reward!r}: use 'score' (score differences) or 'won' (won_reward on a win)")


def _textworld() -> Any:
    """The textworld module, imported only when a game is made or starts (an optional extra)."""
    try:
        import textworld
    except ImportError as error:
        raise ImportError("TextWorld games need the textworld extra: pip install 'flashreinforce[textworld]' "
                          "(install torch==2.13.0 first for the CPU wheel)") from error
    return textworld


class TextWorldSession:
    """Plays one game file at a time with textworld.start; the game stays loaded across resets of the same file.

    `wrappers` makes fresh TextWorld wrappers for each start (ALFWorld's demangler must not be shared).
    Episodes are deterministic: TextWorld games have no randomness once generated, so replaying an episode's
    commands into a fresh reset reproduces its observations.
    """

    def __init__(self, settings: SessionSettings, wrappers: Callable[[], list] = list) -> None:
        self.settings = settings
        self._wrappers = wrappers
        self._game: Any = None
        self._path = ""
        self._task = ""
        self._score = 0.0
        self._step = 0
        self._done = True
        self._history: list[tuple[str, str]] = []
        self._current = ""

    def reset(self, path: str) -> str:
        if path != self._path or self._game is None:
            self.close()
            textworld = _textworld()
            if not os.path.isfile(path):
                raise ValueError(f"no game file {path}: generate games with generate_textworld_games(directory, n, "
                                 "seed=...) or point game_dir / ALFWORLD_DATA at the folder that holds them")
            infos = textworld.EnvInfos(admissible_commands=True, won=True, lost=True, score=True, objective=True)
            self._game = textworld.start(path, request_infos=infos, wrappers=self._wrappers())
            self._path = path
        state = self._game.reset()
        self._task, feedback = self._task_and_text(state)
        self._score, self._step, self._done, self._history = float(state.get("score") or 0), 0, False, []
        self._current = feedback
        return self._render(state)

    def _task_and_text(self, state: Any) -> tuple[str, str]:
        settings = self.settings
        if settings.task_marker:
            text = clean_feedback(state["feedback"], drop_lines=settings.drop_lines)
            return split_task(text, settings.task_marker)
        objective = (state.get("objective") or "").strip()
        return objective, clean_feedback(state["feedback"], objective=objective, drop_lines=settings.drop_lines)

    def _render(self, state: Any) -> str:
        k = self.settings.history
        history = None if k is None else (self._history[-k:] if k else [])
        # A finished game's commands are of no use: the episode ends with this observation.
        admissible = () if self._done else state.get("admissible_commands") or ()
        return render_observation(self._task, self._current, admissible, step=self._step, history=history)

    def step(self, action: str) -> StepResult:
        assert self._game is not None and not self._done, "step() needs a reset() and an episode not yet done"
        command = parse_command(action)
        state, score, game_over = self._game.step(command)
        self._history.append((self._current, command))
        self._step += 1
        self._current = clean_feedback(state["feedback"], drop_lines=self.settings.drop_lines)
        won, lost = bool(state.get("won")), bool(state.get("lost"))
        score = float(score or 0)
        if self.settings.reward == "score":
            reward = score - self._score
        else:
            reward = self.settings.won_reward if won else 0.0
        self._score = score
        self._done = game_over or won or lost or self._step >= self.settings.max_steps
        info = {"success": won, "won": won, "lost": lost, "score": score}
        return StepResult(self._render(state), reward, self._done, info)

    def close(self) -> None:
        if self._game is not None:
            self._game.close()
        self._game, self._path = None, ""


# ---------------------------------------------------------------- TextWorld


class TextWorldEnv:
    """TextWorld games from `game_dir`; a prompt's ground_truth is its game file's path relative to game_dir
    (what generate_textworld_games writes). Reward: the change of the game's score each step; success: won."""

    def __init__(self, game_dir: str = ".", max_steps: int = 50, history: int | None = None) -> None:
        self.game_dir = Path(game_dir)
        self.session = TextWorldSession(SessionSettings(max_steps=max_steps, history=history))

    def reset(self, prompt: Prompt, seed: int) -> str:
        # seed is unused: a generated game has no randomness left in it.
        return self.session.reset(str(self.game_dir / prompt.ground_truth))

    def step(self, action: str) -> StepResult:
        return self.session.step(action)

    def close(self) -> None:
        self.session.close()


def generate_textworld_games(directory: str | os.PathLike, n: int, seed: int, *, world_size: int = 3,
                             nb_objects: int = 5, quest_length: int = 2) -> list[Prompt]:
    """`n` games made locally with TextWorld's generator (as `tw-make custom`), as prompts for TextWorldEnv.

    Game seeds come from `seed`; a game file already in `directory` is reused, since a seed always makes the
    same game. ground_truth: the .z8 file name; difficulty: the quest length. About 0.5 s a game.
    """
    textworld = _textworld()
    from textworld.generator import QuestGenerationError

    if n < 0:
        raise ValueError(f"n={n}: use a count >= 0")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng, seeds = random.Random(f"textworld/{seed}"), []
    while len(seeds) < n:
        # TextWorld's own seeds are below 65635; draw distinct ones.
        if (game_seed := rng.randrange(65635)) not in seeds:
            seeds.append(game_seed)
    prompts = []
    for game_seed in seeds:
        name = f"tw-w{world_size}-o{nb_objects}-q{quest_length}-s{game_seed}.z8"
        if not (directory / name).is_file():
            options = textworld.GameOptions()
            options.seeds, options.nb_rooms, options.nb_objects = game_seed, world_size, nb_objects
            options.quest_length = quest_length
            options.path = str((directory / name).resolve())
            try:
                textworld.make(options)
            except QuestGenerationError as error:
                raise ValueError(f"TextWorld cannot make a quest of quest_length={quest_length} with "
                                 f"world_size={world_size}, nb_objects={nb_objects}: lower quest_length or "
                                 "raise world_size / nb_objects") from error
        prompts.append(Prompt(id=f"textworld/{name[:-3]}", prompt=INSTRUCTION, ground_truth=name,
                              data_source="textworld", difficulty=float(quest_length)))
    return prompts


# ---------------------------------------------------------------- ALFWorld


def alfworld_data_dir(data_dir: str | None = None) -> Path:
    """The ALFWorld data folder: `data_dir`, else $ALFWORLD_DATA; a clear error when neither exists."""
    chosen = data_dir or os.environ.get("ALFWORLD_DATA", "")
    if not chosen:
        raise ValueError(f"ALFWORLD_DATA is not set. {_ALFWORLD_DOWNLOAD}")
    path = Path(os.path.expandvars(chosen)).expanduser()
    if not path.is_dir():
        raise ValueError(f"ALFWorld data folder {path} (ALFWORLD_DATA or data_dir) does not exist. {_ALFWORLD_DOWNLOAD}")
    return path


def alfworld_prompts(split: str = "train", *, data_dir: str | None = None, n: int | None = None) -> list[Prompt]:
    """ALFWorld's text games of `split` (train | valid_seen | valid_unseen), sorted; ground_truth: the
    game.tw-pddl path relative to the data folder. Skips what ALFWorld's own loader skips (movable / sliced
    tasks, games marked unsolvable)."""
    if split not in ALFWORLD_SPLITS:
        raise ValueError(f"split={split!r}: use one of {ALFWORLD_SPLITS}")
    root = alfworld_data_dir(data_dir)
    games = sorted(p for p in (root / "json_2.1.1" / split).rglob("game.tw-pddl")
                   if "movable" not in str(p) and "Sliced" not in str(p) and '"solvable": false' not in p.read_text())
    if not games:
        raise ValueError(f"no game.tw-pddl under {root / 'json_2.1.1' / split}. {_ALFWORLD_DOWNLOAD}")
    return [Prompt(id=f"alfworld/{split}/{index:05d}", prompt=INSTRUCTION, ground_truth=str(path.relative_to(root)),
                   data_source="alfworld") for index, path in enumerate(games[:n])]


def _alfworld_wrappers() -> list:
    try:
        from alfworld.agents.environment.alfred_tw_env import (
            AlfredDemangler,
            AlfredInfos,
        )
    except ImportError as error:
        raise ImportError("ALFWorldEnv needs the alfworld package: pip install alfworld (then alfworld-download "
                          "for its games; where building its fast-downward-textworld dependency fails with 'No "
                          "module named ...' beside an editable install of this project, run pip install "
                          "setuptools wheel && pip install --no-build-isolation fast-downward-textworld "
                          "first)") from error
    return [AlfredDemangler(shuffle=False), AlfredInfos]


def alfworld_settings(max_steps: int = 50, history: int | None = 2, won_reward: float = 10.0) -> SessionSettings:
    """The common ALFWorld setup: 50 steps, reward 10 on a win, the task and the last 2 steps in each observation."""
    return SessionSettings(max_steps=max_steps, history=history, reward="won", won_reward=won_reward,
                           task_marker=ALFWORLD_TASK_MARKER, drop_lines=(_ALFWORLD_WELCOME,))


class ALFWorldEnv:
    """ALFWorld's text games (reward won_reward = 10 on a win, else 0; success: won). A prompt's ground_truth is
    its game.tw-pddl path relative to the data folder (alfworld_prompts). Needs `pip install alfworld` and
    its downloaded data (`alfworld-download`, ALFWORLD_DATA)."""

    def __init__(self, data_dir: str | None = None, max_steps: int = 50, history: int | None = 2,
                 won_reward: float = 10.0) -> None:
        self.data_dir = alfworld_data_dir(data_dir)
        self.session = TextWorldSession(alfworld_settings(max_steps, history, won_reward), _alfworld_wrappers)

    def reset(self, prompt: Prompt, seed: int) -> str:
        return self.session.reset(str(self.data_dir / prompt.ground_truth))

    def step(self, action: str) -> StepResult:
        return self.session.step(action)

    def close(self) -> None:
        self.session.close()
