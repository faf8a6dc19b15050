"""The endpoint of a run: the OpenAI-compatible server over its engine, and the agent pool of its agent tasks (the
user's agents, env.kind=agent, and verifiers environments, env.kind=verifiers, whose agents call the policy too).

Built (nothing started) by `build_agent_parts` when a task has such a kind or endpoint.serve is set; started
by `start_agent_parts`, which binds the server (loopback by default), writes endpoint.json (its URL and key, readable
by the owner only) into the run directory, and starts the agent workers. The stack closes both.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
from pathlib import Path
from typing import Any

from flashreinforce.config import RunConfig, TaskConfig
from flashreinforce.controller.agent_episodes import Settings
from flashreinforce.controller.episodes import AgentParts
from flashreinforce.endpoint.chat import CHAT_TEMPLATES
from flashreinforce.endpoint.service import Endpoint
from flashreinforce.envs.agent_worker import AgentSpec, BuiltinAgent
from flashreinforce.envs.agents import AgentPool
from flashreinforce.envs.verifiers_env import EXTRA_HINT as VERIFIERS_HINT

EXTRA_HINT = "pip install -e '.[endpoint]' (aiohttp serves the endpoint, openai is the agents' client)"


def agent_functions(config: RunConfig) -> dict[str, AgentSpec]:
    """Each agent task's agent, by task name ("" in a one-task run)."""
    return {name: agent_spec(task) for name, task in config.task_list() if task.env.through_endpoint}


def agent_spec(task: TaskConfig) -> AgentSpec:
    """The user's agent (env.kind=agent), or the adapter that plays a verifiers environment's episodes."""
    if task.env.is_agent:
        return task.env.agent
    return BuiltinAgent("flashreinforce.envs.verifiers_env:make_agent",
                        {"env": dict(task.env.options), "eval": task.data.env.eval}, "env.kind=verifiers")


def serves_endpoint(config: RunConfig) -> bool:
    return config.endpoint.serve or bool(agent_functions(config))


def check_endpoint(config: RunConfig) -> None:
    """Before any work: the extra is installed, and a template file given exists."""
    if not serves_endpoint(config):
        return
    missing = [name for name in ("aiohttp", "openai") if importlib.util.find_spec(name) is None]
    if missing:
        kinds = {task.env.kind for _, task in config.task_list() if task.env.through_endpoint}
        why = f"env.kind={' and '.join(sorted(kinds))}" if kinds else "endpoint.serve=true"
        hint = f"{VERIFIERS_HINT} (it holds what the endpoint needs)" if "verifiers" in kinds else EXTRA_HINT
        raise ValueError(f"{why} needs {' and '.join(missing)}: {hint}")
    chat_template(config)
    if config.backend.kind != "local":
        raise ValueError(f"the endpoint (env.kind=agent, endpoint.serve) runs with backend.kind=local; "
                         f"backend.kind={config.backend.kind} does not serve it yet")


def chat_template(config: RunConfig) -> str | None:
    """endpoint.chat_template as Jinja text: None (the tokenizer's), a name of CHAT_TEMPLATES, or a file."""
    return template_text(config.endpoint.chat_template, "endpoint.chat_template")


def template_text(given: str | None, setting: str) -> str | None:
    """A chat template setting as Jinja text (None stays None: the tokenizer's)."""
    if given is None or given in CHAT_TEMPLATES:
        return CHAT_TEMPLATES.get(given)
    path = Path(given)
    if not path.is_file():
        raise ValueError(f"{setting}={given!r} is neither one of {sorted(CHAT_TEMPLATES)} nor a file")
    return path.read_text()


def model_name(config: RunConfig) -> str:
    """The model id /v1/models lists (requests may name any model: there is one)."""
    return Path(config.model.path).name if config.model.path else f"flashreinforce-{config.name}"


def build_agent_parts(config: RunConfig, tokenizer: Any, context: int,
                      stack: contextlib.AsyncExitStack) -> tuple[AgentParts, Any] | None:
    """The endpoint, its server and the agent pool (not started), and the server; None when the run serves none."""
    if not serves_endpoint(config):
        return None
    check_endpoint(config)
    from flashreinforce.endpoint.server import EndpointServer  # the endpoint extra, just checked

    options = config.endpoint
    endpoint = Endpoint(tokenizer, runner=None, model_name=model_name(config), max_context=context,
                        max_new_tokens=config.rollout.max_new_tokens, chat_template=chat_template(config),
                        max_pending=options.max_pending_calls)
    server = EndpointServer(endpoint, api_key=options.api_key or secrets.token_urlsafe(24), host=options.host,
                            port=options.port)
    stack.push_async_callback(server.stop)
    envs = [task.env for _, task in config.task_list() if task.env.through_endpoint] or [config.env]
    pool = AgentPool(agent_functions(config), timeout_s=max(env.agent_timeout_s for env in envs),
                     min_workers=max(env.min_workers for env in envs),
                     max_workers=max(max(env.min_workers, env.max_workers) for env in envs))
    stack.push_async_callback(pool.aclose)
    settings = Settings(base_url=server.base_url, api_key=server.api_key, lockstep=config.deterministic)
    return AgentParts(endpoint, pool, settings), server


async def start_agent_parts(parts: tuple[AgentParts, Any] | None, run_dir: Path | None) -> None:
    """Bind the server, write endpoint.json into `run_dir` (a run's; None: an evaluation's, which writes none),
    start the agent workers (an agent that cannot be imported fails here, saying why)."""
    if parts is None:
        return
    agents, server = parts
    await server.start()
    if run_dir is not None:
        write_descriptor(server, agents, run_dir / "endpoint.json")
    if agents.pool.functions:
        await agents.pool.start()


def write_descriptor(server: Any, agents: AgentParts, path: Path) -> None:
    """endpoint.json: the URLs, the key and the model, readable by the owner only."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the key: its owner only
    with os.fdopen(descriptor, "w") as file:
        json.dump({"base_url": server.base_url(), "episode_base_url": server.base_url("<episode>"),
                   "api_key": server.api_key, "model": agents.endpoint.model_name}, file, indent=2)
