"""Environments of the hubs' libraries for the tests, as source written into a test's directory (so that importing
this module needs neither library): a verifiers taskset package and an OpenEnv environment module, each with a
reward that varies with what a random tiny model writes (the parity of its reply's length), and faults to inject.
The shipped examples (examples/hubs/) are the readable ones; these exist for what a test must force."""

from __future__ import annotations

from pathlib import Path

VERIFIERS_PACKAGE = "vf_parity"
VERIFIERS_SOURCE = '''
"""Tasks "say something (k)"; the reward is the parity of the last reply's length. fault: where it breaks (some: the
reward of every eighth task is not a number)."""
from typing import Literal

import verifiers.v1 as vf
from openai import AsyncOpenAI


class ParityData(vf.TaskData):
    answer: str = ""


class ParityTask(vf.Task[ParityData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def parity(self, task, trace):
        if task.answer == "fault:reward":
            return "high"
        if task.answer == "fault:nan":
            return float("nan")
        return float(len(trace.last_reply) % 2)


class ParityConfig(vf.TasksetConfig):
    split: Literal["train", "test"] = "train"
    size: int = 64
    fault: Literal["none", "load", "tasks", "episode", "reward", "nan", "some"] = "none"


class ParityTaskset(vf.Taskset[ParityTask, ParityConfig]):
    def __init__(self, config):
        if config.fault == "load":
            raise RuntimeError("the parity taskset cannot load")
        super().__init__(config)

    def load(self):
        for k in range(self.config.size):
            if self.config.fault == "tasks" and k == 2:
                raise RuntimeError("the parity taskset broke at its third task")
            answer = f"fault:{self.config.fault}" if self.config.fault in ("episode", "reward", "nan") else ""
            if self.config.fault == "some" and k % 8 == 7:
                answer = "fault:reward"
            yield ParityTask(ParityData(prompt=f"Say something ({self.config.split} {k}).", answer=answer),
                             self.config.task)


class TwoCalls(vf.Harness[vf.HarnessConfig]):
    """Asks twice, the second call continuing the first's conversation (one trajectory, token for token)."""

    NEEDS_CONTAINER = False
    EXECUTES_CODE = False
    APPENDS_SYSTEM_PROMPT = True

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        if data.answer == "fault:episode":
            raise RuntimeError("the parity harness broke mid-episode")
        _, prompt = self.resolve_prompt(data)
        messages = [{"role": "user", "content": prompt}]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for _ in range(2):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=8)
                text = reply.choices[0].message.content or ""
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "More."}]
        return vf.ProgramResult(0, text, "")


__all__ = ["ParityTask", "ParityTaskset", "TwoCalls"]
'''

OPENENV_MODULE = "openenv_parity"
OPENENV_SOURCE = '''
"""Two steps; each pays the parity of the action's length. fault: where it breaks."""
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class ParityAction(Action):
    text: str


class ParityObservation(Observation):
    prompt: str = ""


class ParityEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, fault: str = "none", steps: int = 2):
        super().__init__()
        self.fault, self.steps, self.seed, self._state = fault, steps, None, State(step_count=0)

    def reset(self, seed=None, episode_id=None):
        if self.fault == "reset":
            raise RuntimeError("the parity environment cannot reset")
        self.seed, self._state = seed, State(episode_id=episode_id, step_count=0)
        return ParityObservation(prompt=f"Say something ({seed}).")

    def step(self, action: ParityAction):
        self._state.step_count += 1
        if self.fault == "step":
            raise RuntimeError("the parity environment broke mid-episode")
        reward = float(len(action.text) % 2)
        if self.fault == "reward":
            reward = float("nan")
        return ParityObservation(prompt="Again.", reward=reward, done=self._state.step_count >= self.steps)

    @property
    def state(self):
        return self._state


class Unannotated(Environment):
    def reset(self, seed=None, episode_id=None):
        return ParityObservation()

    def step(self, action):
        return ParityObservation()

    @property
    def state(self):
        return State()


app = create_app(ParityEnvironment, ParityAction, ParityObservation, max_concurrent_envs=64)
'''


def write_hub_envs(directory: Path) -> Path:
    """Write both into `directory` (put it on sys.path / PYTHONPATH to import them); returns it."""
    package = directory / VERIFIERS_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(VERIFIERS_SOURCE)
    (directory / f"{OPENENV_MODULE}.py").write_text(OPENENV_SOURCE)
    return directory
