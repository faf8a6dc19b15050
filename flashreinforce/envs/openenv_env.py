"""OpenEnv environments as Envs (env.kind=openenv; the `openenv` extra, openenv-core 0.3).

An OpenEnv environment is a Gym-style class (`openenv.core.Environment`: `reset(seed, episode_id)` and
`step(action)` each return an Observation carrying `reward` and `done`), served by OpenEnv over HTTP and a
WebSocket, one session per episode. env.options names where it runs, exactly one of:

- `env: package.module:MyEnvironment`: in-process, one instance per episode in the environment worker
  (`env_kwargs` its constructor's arguments);
- `app: package.module:app`: its FastAPI app (OpenEnv's `server/app.py`), served by uvicorn on 127.0.0.1 from each
  environment worker, in a process of its own that dies with the worker; each episode one WebSocket session;
- `base_url`: a server already running (one you started, a container), reached the same way.

Each model turn is one action: the turn's text fills the action's field `action_field` (by default the action's
only required field; any value the field's type parses, as OpenEnv's own server validates it). Each observation is
rendered as text: its `observation_field`, or its only field, else one `name: value` line per field (`reward`,
`done` and `metadata` are not shown). Its reward is the step's reward (None counts 0); `done` ends the episode. The
episode resets with a seed from the prompt's id, so every sample of a prompt meets the same episode, its id as
`episode_id`, and `reset_kwargs`. An environment that raises, refuses an action, or gives a reward that is not a
number ends its episode (env_error, scored 0 and counted), as any environment's error does.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import typing
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from flashreinforce.envs.protocol import StepResult
from flashreinforce.lifetime import describe_exit, die_with_parent
from flashreinforce.types import Prompt
from flashreinforce.user_code import import_file

EXTRA_HINT = "pip install -e '.[openenv]'"
HIDDEN_FIELDS = ("reward", "done", "metadata")
"""Observation fields OpenEnv sends beside the observation, never shown to the model."""


def import_object(reference: str, setting: str) -> Any:
    """The object `package.module:name` or `path/to/file.py:name` (relative to the working directory) names."""
    target, colon, name = reference.rpartition(":")
    if not colon or not target or not name:
        raise ValueError(f"{setting}={reference!r}: write 'package.module:Name' or 'path/to/file.py:Name'")
    path = Path(target).resolve()
    if target.endswith(".py") and not path.is_file():
        raise ValueError(f"{setting}={reference!r}: no file {path} (relative to {Path.cwd()})")
    try:
        if target.endswith(".py"):
            module = import_file(path, "openenv")
        else:
            module = importlib.import_module(target)
    except ImportError as error:
        raise ValueError(f"{setting}={reference!r}: {error} (is it installed, or on PYTHONPATH?)") from None
    found = getattr(module, name, None)
    if found is None:
        raise ValueError(f"{setting}={reference!r}: {target} has no {name!r}")
    return found


def episode_seed(prompt_id: str) -> int:
    """The reset seed of a prompt's episodes: a function of its id, so a group's samples meet the same episode."""
    return zlib.crc32(prompt_id.encode()) & 0x7FFFFFFF


def seeded_prompts(instruction: str, *, num_train: int | None, num_eval: int, chat: bool = True,
                   source: str = "openenv") -> tuple[list[Prompt], list[Prompt]]:
    """data.kind=env with env.kind=openenv: one prompt per episode, the instruction its text (a user message with
    `chat`); train and held-out ids differ, and so do their seeds (episode_seed)."""
    text = ({"role": "user", "content": instruction},) if chat else instruction

    def rows(split: str, count: int) -> list[Prompt]:
        return [Prompt(id=f"{split}/{k:06d}", prompt=text, ground_truth="", data_source=source) for k in range(count)]

    return rows("train", 1000 if num_train is None else num_train), rows("eval", num_eval)


# ---- what the model reads ---------------------------------------------------------------------------------------


def render_observation(observation: dict[str, Any], field: str | None = None) -> str:
    """An observation's fields (reward, done and metadata aside) as the text the model reads."""
    shown = {k: v for k, v in observation.items() if k not in HIDDEN_FIELDS}
    if field is not None:
        if field not in shown:
            raise KeyError(f"env.options.observation_field={field!r}: the observation has {sorted(shown)}")
        return _text(shown[field])
    if len(shown) == 1:
        return _text(next(iter(shown.values())))
    return "\n".join(f"{name}: {_text(value)}" for name, value in shown.items())


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def step_reward(value: Any, where: str) -> float:
    if value is None:
        return 0.0
    if not isinstance(value, (bool, int, float)) or not math.isfinite(value):
        raise TypeError(f"{where} gave the reward {value!r:.80}; an OpenEnv reward is a finite number or None")
    return float(value)


def action_field_of(schema: dict[str, Any], where: str) -> str:
    """The action's field a turn's text fills: its only required field (metadata aside), or its only field."""
    fields = [f for f in schema.get("properties", {}) if f != "metadata"]
    required = [f for f in schema.get("required", []) if f != "metadata"]
    if len(required) == 1:
        return required[0]
    if not required and len(fields) == 1:
        return fields[0]
    raise ValueError(f"{where}: the action has the fields {fields}; name the one the model's text fills: "
                     "env.options.action_field")


# ---- sessions: in-process, or a server's WebSocket -----------------------------------------------------------


class Session(Protocol):
    """One episode's environment; reset and step answer as OpenEnv's server does: {observation, reward, done}."""

    def reset(self, **kwargs: Any) -> dict[str, Any]: ...

    def step(self, action: dict[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


class InProcessSession:
    def __init__(self, env_class: type, env_kwargs: dict[str, Any], action_class: type) -> None:
        self.env, self.action_class = env_class(**env_kwargs), action_class

    def reset(self, **kwargs: Any) -> dict[str, Any]:
        from openenv.core.env_server.serialization import serialize_observation

        return serialize_observation(self.env.reset(**accepted(self.env.reset, kwargs)))

    def step(self, action: dict[str, Any]) -> dict[str, Any]:
        from openenv.core.env_server.serialization import deserialize_action, serialize_observation

        return serialize_observation(self.env.step(deserialize_action(action, self.action_class)))

    def close(self) -> None:
        self.env.close()


def accepted(function: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `function` takes (OpenEnv's server passes reset only those)."""
    parameters = inspect.signature(function).parameters
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in parameters}


class RemoteSession:
    """An episode as a session of an OpenEnv server, through OpenEnv's own client (its WebSocket)."""

    def __init__(self, base_url: str, message_timeout_s: float) -> None:
        from openenv.core import GenericEnvClient

        self.client = GenericEnvClient(base_url=base_url, message_timeout_s=message_timeout_s).sync()
        self.client.connect()

    def reset(self, **kwargs: Any) -> dict[str, Any]:
        return _as_payload(self.client.reset(**kwargs))

    def step(self, action: dict[str, Any]) -> dict[str, Any]:
        return _as_payload(self.client.step(action))

    def close(self) -> None:
        self.client.close()


def _as_payload(result: Any) -> dict[str, Any]:
    return {"observation": result.observation, "reward": result.reward, "done": result.done}


# ---- the Env ------------------------------------------------------------------------------------------------


class OpenEnvEnv:
    """One episode of an OpenEnv environment (built per episode by the environment worker)."""

    def __init__(self, env: str | None = None, app: str | None = None, base_url: str | None = None, *,
                 env_kwargs: dict[str, Any] | None = None, action: str | None = None,
                 action_field: str | None = None, observation_field: str | None = None,
                 reset_kwargs: dict[str, Any] | None = None, startup_timeout_s: float = 60.0,
                 message_timeout_s: float = 60.0) -> None:
        given = [name for name, value in (("env", env), ("app", app), ("base_url", base_url)) if value]
        if len(given) != 1:
            raise ValueError(f"env.kind=openenv: give exactly one of env.options.env (an Environment class, run "
                             "in-process), app (its server's app, served here on 127.0.0.1) or base_url (a running "
                             f"server); given: {given or 'none'}")
        if importlib.util.find_spec("openenv") is None:
            raise ValueError(f"env.kind=openenv needs the openenv extra: {EXTRA_HINT}")
        self.where = f"the OpenEnv environment {env or app or base_url}"
        self.observation_field, self.reset_kwargs = observation_field, dict(reset_kwargs or {})
        if env:
            env_class = import_object(env, "env.options.env")
            action_class = import_object(action, "env.options.action") if action else action_type(env_class)
            schema = action_class.model_json_schema()
            self.connect = lambda: InProcessSession(env_class, dict(env_kwargs or {}), action_class)
        else:
            url = base_url or local_server(app, startup_timeout_s)
            schema = server_schema(url, startup_timeout_s)["action"]
            self.connect = lambda: RemoteSession(url, message_timeout_s)
        self.action_field = action_field or action_field_of(schema, self.where)
        self.session: Session | None = None
        self.turn = 0

    def reset(self, prompt: Prompt, seed: int) -> str:
        del seed  # the sampling seed differs between a prompt's samples; the episode must not (episode_seed)
        self.close()
        self.session, self.turn = self.connect(), 0
        payload = self.session.reset(**{"seed": episode_seed(prompt.id), "episode_id": prompt.id,
                                        **self.reset_kwargs})
        return self._observation(payload, "reset")

    def step(self, action: str) -> StepResult:
        assert self.session is not None, "step() needs a reset()"
        self.turn += 1
        payload = self.session.step({self.action_field: action})
        where = f"{self.where} (turn {self.turn})"
        return StepResult(self._observation(payload, where), step_reward(payload.get("reward"), where),
                          bool(payload.get("done")), {})

    def _observation(self, payload: dict[str, Any], where: str) -> str:
        observation = payload.get("observation")
        if not isinstance(observation, dict):
            raise TypeError(f"{self.where} ({where}) gave the observation {observation!r:.80}, not its fields")
        return render_observation(observation, self.observation_field)

    def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.close()


def action_type(env_class: type) -> type:
    """The Action class an Environment's step takes: its annotation, or Environment[Action, ...]'s parameter."""
    hint = typing.get_type_hints(env_class.step).get("action")
    candidates = [hint, *(typing.get_args(base)[0] for base in getattr(env_class, "__orig_bases__", ())
                          if typing.get_args(base))]
    for candidate in candidates:
        if isinstance(candidate, type) and hasattr(candidate, "model_json_schema"):
            return candidate
    raise ValueError(f"env.options.env: {env_class.__name__}.step does not say its Action class; name it: "
                     "env.options.action=package.module:MyAction")


def server_schema(base_url: str, timeout_s: float) -> dict[str, Any]:
    """The server's /schema (its action's, observation's and state's JSON schemas), fetched once per process."""
    if base_url not in _SCHEMAS:
        url = f"{base_url.rstrip('/')}/schema"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                _SCHEMAS[base_url] = json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError) as error:
            raise ValueError(f"env.options.base_url={base_url!r}: no OpenEnv server answers {url} ({error})") from None
    return _SCHEMAS[base_url]


_SCHEMAS: dict[str, dict[str, Any]] = {}


# ---- a server of this worker's own ----------------------------------------------------------------------------


@dataclass
class LocalServer:
    process: subprocess.Popen
    url: str
    log: Any

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()


_SERVERS: dict[str, LocalServer] = {}


def local_server(app: str, timeout_s: float) -> str:
    """The URL of `app` served by uvicorn on 127.0.0.1 for this process (started at its first use)."""
    server = _SERVERS.get(app)
    if server is None or server.process.poll() is not None:
        if server is not None:
            server.stop()
        server = _SERVERS[app] = start_server(app, timeout_s)
    return server.url


def start_server(app: str, timeout_s: float) -> LocalServer:
    """`python -m flashreinforce.envs.openenv_env <app> <fd> <our pid>` on a socket bound here to a free loopback
    port (nothing can take the port in between); waits until it answers /health."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    log = tempfile.TemporaryFile()  # noqa: SIM115 - the server's output; LocalServer closes it when it stops
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with listener:
        process = subprocess.Popen([sys.executable, "-m", __name__, app, str(listener.fileno()), str(os.getpid())],
                                   pass_fds=(listener.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT)
    server = LocalServer(process, url, log)
    deadline = time.monotonic() + timeout_s
    while not _healthy(url):
        if process.poll() is not None or time.monotonic() > deadline:
            why = (f"exited ({describe_exit(process.returncode)})" if process.poll() is not None
                   else f"did not answer /health within {timeout_s:.0f} s")
            log.seek(0)
            output = log.read()[-2000:].decode(errors="replace")
            server.stop()
            raise RuntimeError(f"env.options.app={app!r}: its server {why}; its output:\n{output}")
        time.sleep(0.1)
    return server


def _healthy(url: str) -> bool:
    health = f"{url}/health"
    with contextlib.suppress(urllib.error.URLError, OSError), urllib.request.urlopen(health, timeout=2) as response:
        return response.status == 200
    return False


@atexit.register
def _stop_servers() -> None:
    for server in _SERVERS.values():
        server.stop()


def serve(app: str, fd: int) -> None:
    import uvicorn

    application = import_object(app, "env.options.app")
    listener = socket.socket(fileno=fd)
    uvicorn.Server(uvicorn.Config(application, log_level="warning")).run(sockets=[listener])


if __name__ == "__main__":
    die_with_parent(int(sys.argv[3]))
    serve(sys.argv[1], int(sys.argv[2]))
