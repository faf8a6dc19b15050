"""One environment worker: the sessions of the run's environments, and the process that serves them to pool.py.

`python -m flashreinforce.envs.worker <fd> <pool pid>` is a fresh interpreter (not a fork of the trainer, with its
threads and memory) that builds environments of each task's EnvSpec and holds many of them at once, one per
episode ("session"), each of the kind of its prompt's task. The Ray backend serves the same EnvSessions from an actor instead (controller/ray_envs.py).
Protocol (pickled over the socket; the same tuples as an actor's arguments and answers):
  pool -> worker: (sys_path, {task: spec}) once; then
                  ("open", sid, prompt, seed, actions): reset, replay `actions`  -> ("ok", reset observation)
                  ("step", sid, action)                                          -> ("ok", StepResult)
                  ("close", sid)                                                 -> no answer
  worker -> pool: ("ready", None) or ("load_error", message) once; ("error", message) instead of "ok" when the
                  environment raised (its session is then closed).
A step that never returns is the pool's to end: it kills this process and replays the other sessions elsewhere.
Every observation the model will see is checked here (envs.protocol.check_observation: one <image> per image,
images that decode), so a bad one is its environment's error, answered as "error" like a raise.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping
from multiprocessing.connection import Connection

from flashreinforce.envs.protocol import Env, EnvSpec, as_step_result, build_env, check_observation
from flashreinforce.lifetime import describe_error, die_with_parent


EnvSpecs = Mapping[str, EnvSpec]
"""The environment of each task a worker serves, by task name ("" for a one-task run's)."""


def as_specs(spec: EnvSpec | EnvSpecs) -> dict[str, EnvSpec]:
    return {"": spec} if isinstance(spec, EnvSpec) else dict(spec)


def check_env(specs: EnvSpec | EnvSpecs) -> tuple[str, str | None]:
    """("ready", None) when an environment of every spec builds, else ("load_error", why): a worker fails at its
    start, with the reason, not at the first episode."""
    for task, spec in as_specs(specs).items():
        try:
            build_env(spec).close()
        except Exception as error:  # noqa: BLE001 - any failure of user code is reported, not raised
            return "load_error", f"{f'task {task}: ' if task else ''}{describe_error(error)}"
    return "ready", None


class EnvSessions:
    """The open environments of one worker, by session id, each of its prompt's task's kind (a worker holds
    environments of several kinds at once); answers the protocol's messages."""

    def __init__(self, specs: EnvSpec | EnvSpecs) -> None:
        self.specs = as_specs(specs)
        self.envs: dict[str, tuple[Env, EnvSpec]] = {}
        self.turns: dict[str, int] = {}
        """Steps each open session took (replayed ones too): a bad observation's error names its turn."""

    def spec_for(self, prompt) -> EnvSpec:
        spec = self.specs.get(prompt.task)
        if spec is None:
            raise RuntimeError(f"prompt {prompt.id} is of task {prompt.task!r}, which has no environment here "
                               f"(tasks with one: {sorted(self.specs)})")
        return spec

    def handle(self, message: tuple) -> tuple[str, object] | None:
        """The answer to one message (None for "close", which has none)."""
        kind, sid = message[0], message[1]
        if kind == "close":
            self.turns.pop(sid, None)
            _close(self.envs.pop(sid, None))
            return None
        try:
            return "ok", self._open(*message[1:]) if kind == "open" else self._step(sid, message[2])
        except Exception as error:  # noqa: BLE001 - an environment's error ends its episode, not the worker
            self.turns.pop(sid, None)
            _close(self.envs.pop(sid, None))
            return "error", describe_error(error)

    def _open(self, sid: str, prompt, seed: int, actions) -> object:
        _close(self.envs.pop(sid, None))
        spec = self.spec_for(prompt)
        env = build_env(spec)
        self.envs[sid] = env, spec
        observation = env.reset(prompt, seed)
        check_observation(observation, f"env {spec.kind!r} reset")
        for action in actions:  # deterministic: the same observations the episode saw before
            as_step_result(env.step(action), spec.kind)
        self.turns[sid] = len(actions)
        return observation

    def _step(self, sid: str, action: str) -> object:
        if sid not in self.envs:
            raise RuntimeError(f"session {sid} is not open in this worker")
        env, spec = self.envs[sid]
        result = as_step_result(env.step(action), spec.kind)
        self.turns[sid] += 1
        if not result.done:  # a final observation is never shown to the model
            check_observation(result.observation, f"env {spec.kind!r} turn {self.turns[sid]}")
        return result


def _close(opened: tuple[Env, EnvSpec] | None) -> None:
    if opened is not None:
        with contextlib.suppress(Exception):
            opened[0].close()


def main(fd: int, pool_pid: int) -> None:
    die_with_parent(pool_pid)
    conn = Connection(fd)
    sys_path, specs = conn.recv()
    sys.path[:] = sys_path
    verdict = check_env(specs)
    conn.send(verdict)
    if verdict[0] != "ready":
        return
    sessions = EnvSessions(specs)
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the pool is gone
            return
        reply = sessions.handle(message)
        if reply is not None:
            conn.send(reply)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
