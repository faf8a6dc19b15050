"""One agent worker: a process that runs many episodes of the user's agent at once, on its own event loop.

`python -m flashreinforce.envs.agent_worker <fd> <pool pid>` is a fresh interpreter that imports the agent,
`async def run(client, row) -> float | dict | None` of each agent task (or a built-in adapter's: an environment
whose agents call the policy, env.kind=verifiers), and runs each episode as an asyncio task with an
`openai.AsyncOpenAI` client bound to the episode's base URL. Protocol (pickled over the socket):
  pool -> worker: (sys_path, {task: function}) once               -> ("ready", None) | ("load_error", why)
                  ("run", sid, row, base_url, api_key, timeout_s)  -> later ("done", sid, value) | ("error", sid, why)
                  (the row's "task" picks the function)
                  ("cancel", sid)                                  -> ("cancelled", sid), unless it already ended
An agent that blocks this process's event loop (a busy loop, time.sleep) blocks every episode here: the pool
kills the process when a cancel goes unanswered, and re-runs the other episodes elsewhere (agents.py).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

from flashreinforce.lifetime import describe_error, die_with_parent
from flashreinforce.user_code import import_file

AgentFn = Callable[[Any, dict[str, Any]], Any]
RESULT_KEYS = ("reward", "answer", "passed")
"""What an agent's dict may hold: its reward, the answer text the task's verifier scores, a pass flag."""


class BuiltinAgent(NamedTuple):
    """An adapter of this package that plays a task's episodes: `factory(options)` gives its `run(client, row)`."""

    factory: str
    """'package.module:function'"""
    options: dict[str, Any]
    label: str
    """What its errors name: the setting that chose it (env.kind=verifiers)."""


AgentSpec = str | BuiltinAgent
"""A user's agent by reference ('path/to/agent.py:run', 'package.module:run'), or a built-in adapter."""


def describe_agent(spec: AgentSpec) -> str:
    return spec.label if isinstance(spec, BuiltinAgent) else f"env.agent={spec!r}"


def build_agent(spec: AgentSpec) -> AgentFn:
    if isinstance(spec, str):
        return load_agent(spec)
    module, _, name = spec.factory.partition(":")
    return getattr(importlib.import_module(module), name)(spec.options)


def load_agent(reference: str) -> AgentFn:
    """The coroutine function `path/to/agent.py:run` or `package.module:run` names; errors say what to write."""
    target, colon, name = reference.rpartition(":")
    if not colon or not target or not name:
        raise ValueError(f"env.agent={reference!r}: write 'path/to/agent.py:run' or 'package.module:run'")
    if target.endswith(".py") or "/" in target:
        path = Path(target).resolve()
        if not path.is_file():
            raise ValueError(f"env.agent={reference!r}: no file {path} (relative to {Path.cwd()})")
        module = import_file(path, "agent")
    else:
        module = importlib.import_module(target)
    fn = getattr(module, name, None)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"env.agent={reference!r}: {name} must be `async def {name}(client, row)` "
                         f"(found {type(fn).__name__})")
    try:
        inspect.signature(fn).bind("client", {})
    except TypeError as error:
        raise ValueError(f"env.agent={reference!r}: {name} cannot be called as {name}(client, row) ({error})") from None
    return fn


def check_result(value: Any) -> Any:
    """An agent's return as the pool takes it: a finite number, None, or a dict of RESULT_KEYS; else TypeError."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise TypeError(f"the agent returned {value}, not a finite reward")
        return float(value)
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(RESULT_KEYS))
        reward, answer = value.get("reward"), value.get("answer")
        if (unknown or (reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                                                or not math.isfinite(reward)))
                or (answer is not None and not isinstance(answer, str))
                or not isinstance(value.get("passed", False), bool)):
            raise TypeError(f"the agent returned {value!r:.200}; a dict holds reward (a finite number), answer (the "
                            "text the verifier scores) and passed (bool), nothing else")
        return {k: (float(v) if k == "reward" and v is not None else v) for k, v in value.items()}
    raise TypeError(f"the agent returned a {type(value).__name__}; return a reward, a dict of {RESULT_KEYS}, or None")


class Episodes:
    """The episodes this worker runs, each an asyncio task; replies go back through `send`."""

    def __init__(self, functions: dict[str, AgentFn], send: Callable[[tuple], None]) -> None:
        import openai  # the endpoint extra; imported once, by the worker only

        self.functions, self.send, self.openai = functions, send, openai
        self.tasks: dict[str, asyncio.Task] = {}

    def handle(self, message: tuple) -> None:
        kind, sid = message[0], message[1]
        if kind == "run":
            self.tasks[sid] = asyncio.ensure_future(self._run(sid, *message[2:]))
        elif kind == "cancel" and sid in self.tasks:
            self.tasks[sid].cancel()

    async def _run(self, sid: str, row: dict[str, Any], base_url: str, api_key: str, timeout_s: float) -> None:
        # No retries: every request the agent makes is one call of its episode, answered once.
        client = self.openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s)
        try:
            reply = ("done", sid, check_result(await self.functions[row.get("task", "")](client, row)))
        except asyncio.CancelledError:
            reply = ("cancelled", sid)
        except Exception as error:  # noqa: BLE001 - the agent's failure ends its episode, not the worker
            reply = ("error", sid, describe_error(error))
        finally:
            self.tasks.pop(sid, None)
            await asyncio.shield(client.close())
        self.send(reply)


async def serve(conn: Connection, episodes: Episodes) -> None:
    loop = asyncio.get_running_loop()
    closed = loop.create_future()

    def readable() -> None:
        try:
            while conn.poll():
                episodes.handle(conn.recv())
        except (EOFError, OSError):  # the pool is gone
            if not closed.done():
                closed.set_result(None)

    loop.add_reader(conn.fileno(), readable)
    await closed


def main(fd: int, pool_pid: int) -> None:
    die_with_parent(pool_pid)
    conn = Connection(fd)
    sys_path, references = conn.recv()
    sys.path[:] = sys_path
    try:
        if importlib.util.find_spec("openai") is None:
            raise ValueError("env.kind=agent gives the agent an openai client: pip install -e '.[endpoint]'")
        functions = {task: build_agent(spec) for task, spec in references.items()}
        episodes = Episodes(functions, conn.send)  # imports openai before the worker says it is ready
    except Exception as error:  # noqa: BLE001 - any failure of user code is reported, not raised
        conn.send(("load_error", describe_error(error)))
        return
    conn.send(("ready", None))
    asyncio.run(serve(conn, episodes))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
