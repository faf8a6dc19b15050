"""A small OpenEnv environment that runs offline: guess the number, told higher or lower after each guess.

The usual OpenEnv layout in one package: the Action and Observation models and the Environment here, its HTTP server
(FastAPI, OpenEnv's create_app) in `openenv_guess.server`. flashreinforce runs the environment in-process
(env.options.env=openenv_guess:GuessEnvironment) or serves the app on loopback and plays over its WebSocket
(env.options.app=openenv_guess.server:app), with this directory's parent on PYTHONPATH.
"""

from __future__ import annotations

import random
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    guess: str = Field(..., description="A whole number")


class GuessObservation(Observation):
    feedback: str = Field(default="", description="What the game says")


class GuessEnvironment(Environment):
    """The number is drawn from the reset seed; a right guess pays 1 and ends the game, after `max_guesses` it
    ends with 0."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, high: int = 8, max_guesses: int = 4) -> None:
        super().__init__()
        self.high, self.max_guesses = high, max_guesses
        self._state, self._secret = State(episode_id=str(uuid4()), step_count=0), 0

    def reset(self, seed: int | None = None, episode_id: str | None = None) -> GuessObservation:
        self._secret = random.Random(seed).randint(1, self.high)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GuessObservation(feedback=f"I picked a whole number from 1 to {self.high}. Guess it: reply with the "
                                         "number only.")

    def step(self, action: GuessAction) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        words = action.guess.strip().split()
        guess = int(words[0]) if words and words[0].lstrip("-").isdigit() else None
        if guess == self._secret:
            return GuessObservation(feedback="Right!", reward=1.0, done=True)
        out_of_guesses = self._state.step_count >= self.max_guesses
        hint = "Not a number." if guess is None else "Higher." if guess < self._secret else "Lower."
        return GuessObservation(feedback=hint, reward=0.0, done=out_of_guesses)

    @property
    def state(self) -> State:
        return self._state
