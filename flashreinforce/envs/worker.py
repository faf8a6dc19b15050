"""One environment worker process: `python -m flashreinforce.envs.worker <fd> <pool pid>`, started by pool.py.

A fresh interpreter (not a fork of the trainer, with its threads and memory) that builds environments of one
EnvSpec and holds many of them at once, one per episode ("session"). Protocol over the socket (pickled):
  pool -> worker: (sys_path, spec) once; then
                  ("open", sid, prompt, seed, actions): reset, replay `actions`  -> ("ok", reset observation)
                  ("step", sid, action)                                          -> ("ok", StepResult)
                  ("close", sid)                                                 -> no answer
  worker -> pool: ("ready", None) or ("load_error", message) once; ("error", message) instead of "ok" when the
                  environment raised (its session is then closed).
A step that never returns is the pool's to end: it kills this process and replays the other sessions elsewhere.
"""

from __future__ import annotations

import contextlib
import sys
from multiprocessing.connection import Connection

from flashreinforce.envs.protocol import Env, EnvSpec, as_step_result, build_env
from flashreinforce.lifetime import describe_error, die_with_parent


def main(fd: int, pool_pid: int) -> None:
    die_with_parent(pool_pid)
    conn = Connection(fd)
    sys_path, spec = conn.recv()
    sys.path[:] = sys_path
    try:
        build_env(spec).close()  # fail at start, with the reason, not at the first episode
    except Exception as error:  # noqa: BLE001 - any failure of user code is reported, not raised
        conn.send(("load_error", describe_error(error)))
        return
    conn.send(("ready", None))
    envs: dict[str, Env] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the pool is gone
            return
        kind, sid = message[0], message[1]
        if kind == "close":
            _close(envs.pop(sid, None))
            continue
        try:
            reply = ("ok", _open(envs, spec, *message[1:]) if kind == "open" else _step(envs, spec, sid, message[2]))
        except Exception as error:  # noqa: BLE001 - an environment's error ends its episode, not the worker
            _close(envs.pop(sid, None))
            reply = ("error", describe_error(error))
        conn.send(reply)


def _open(envs: dict[str, Env], spec: EnvSpec, sid: str, prompt, seed: int, actions) -> object:
    _close(envs.pop(sid, None))
    env = build_env(spec)
    envs[sid] = env
    observation = env.reset(prompt, seed)
    for action in actions:  # deterministic: the same observations the episode saw before
        as_step_result(env.step(action), spec.kind)
    return observation


def _step(envs: dict[str, Env], spec: EnvSpec, sid: str, action: str) -> object:
    env = envs.get(sid)
    if env is None:
        raise RuntimeError(f"session {sid} is not open in this worker")
    return as_step_result(env.step(action), spec.kind)


def _close(env: Env | None) -> None:
    if env is not None:
        with contextlib.suppress(Exception):
            env.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
