"""Prime Intellect `verifiers` environments (env.kind=verifiers; the `verifiers` extra, verifiers 0.4).

A verifiers environment is a taskset (its tasks, each scored by its rubric: the task's `@vf.reward` functions and
judges) played by agents (a harness: a program, or a loop in-process, whose model calls reach verifiers' own
interception server, which relays them to a model endpoint). Here:

- its tasks are the run's prompts (data.kind=env, `taskset_prompts`): each row carries its task's data, from which
  the episode rebuilds the task;
- each episode is one `Env.run_episode` in an agent worker (`make_agent`, run by the agent pool as a user's agent
  is), relayed to the episode's base URL on the endpoint: every call its agents make is recorded token for token
  and trained, as an agent's of env.kind=agent;
- the episode's reward is its traces' rubric reward (their mean, for an environment of several agents). An episode
  that fails (a hook or harness that raises, a reward that is not a number) raises here, and the agent pool ends it
  as agent_error, scored 0 and counted.

`env.options` is the environment's config as verifiers takes it (its `[env]` section): `taskset.id` names the
taskset package (installed, or importable from PYTHONPATH), `agent.harness` and `agent.runtime` how its agent runs.
verifiers is imported only here, and only when such a task runs.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import Iterable
from typing import Any

from flashreinforce.lifetime import describe_error
from flashreinforce.types import Prompt

EXTRA_HINT = "pip install -e '.[verifiers]'"
KEY_VARIABLE = "FLASHREINFORCE_ENDPOINT_API_KEY"
"""The environment variable verifiers' client reads the endpoint's key from (it takes keys by variable name). Its
name holds API_KEY: verifiers keeps such variables from the harness programs it starts on this machine, which reach
the model through its interception server, with a secret of their own."""
REMOTE_HINT = ("verifiers runs an agent in Prime's sandboxes, reached through a Prime tunnel, unless "
               "env.options.agent.runtime says otherwise: {type: subprocess} runs it on this machine, {type: docker} "
               "in a container")
MODEL = "policy"


def import_verifiers() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as error:
        raise ValueError(f"env.kind=verifiers needs the verifiers extra: {EXTRA_HINT} ({error})") from None
    return vf


def env_config(options: dict[str, Any]) -> Any:
    """verifiers' EnvConfig of env.options, its taskset and agents resolved; errors name the setting."""
    vf = import_verifiers()
    taskset = options.get("taskset")
    taskset_id = taskset.get("id") if isinstance(taskset, dict) else None
    if not taskset_id:
        raise ValueError("env.kind=verifiers loads an environment by its taskset's id: set env.options.taskset.id "
                         "(an installed environment package, or one importable from PYTHONPATH)")
    try:
        return vf.resolve_env_config(options)
    except ModuleNotFoundError as error:
        raise ValueError(f"env.options.taskset.id={taskset_id!r}: {error} Install the environment's package, or "
                         "put the directory holding it on PYTHONPATH.") from None
    except (ValueError, TypeError, AttributeError) as error:  # pydantic's ValidationError is a ValueError
        raise ValueError(f"env.options (the verifiers environment {taskset_id!r}'s config): {error}") from None


# ---- the run's prompts (main process) -------------------------------------------------------------------------


def taskset_prompts(options: dict[str, Any], *, num_train: int | None, num_eval: int,
                    eval_overrides: dict[str, Any] | None) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out) prompts of the environment's tasks: the first num_train (None: all), and num_eval held
    out, from the eval taskset (env.options.taskset with `eval_overrides`, its eval split) or else the tasks after
    the training ones."""
    config = env_config(options)
    taskset = _load_taskset(config.taskset, config.env_id)
    if eval_overrides is not None:
        train = _tasks(taskset, num_train, config.env_id)
        held_out_config = env_config(eval_options(options, eval_overrides)).taskset
        held_out = _tasks(_load_taskset(held_out_config, config.env_id), num_eval, config.env_id)
    else:
        wanted = None if num_train is None else num_train + num_eval
        tasks = _tasks(taskset, wanted, config.env_id)
        cut = len(tasks) - num_eval if num_train is None else min(num_train, len(tasks))
        train, held_out = tasks[:cut], tasks[cut:]
    if not train:
        raise ValueError(f"the verifiers taskset {config.env_id!r} has no training task left (it holds "
                         f"{len(train) + len(held_out)}, data.env.num_eval={num_eval} held out)")
    return ([_prompt(task, "train", k, config.env_id) for k, task in enumerate(train)],
            [_prompt(task, "eval", k, config.env_id) for k, task in enumerate(held_out)])


def eval_options(options: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    return {**options, "taskset": {**options["taskset"], **overrides}}


def _load_taskset(taskset_config: Any, env_id: str) -> Any:
    vf = import_verifiers()
    try:
        return vf.load_taskset(taskset_config)
    except Exception as error:  # noqa: BLE001 - the environment's own code: named, whatever it raises
        raise ValueError(f"the verifiers taskset {env_id!r} raised while loading: {describe_error(error)}") from None


def _tasks(taskset: Any, count: int | None, env_id: str) -> list[Any]:
    if count is None and not taskset.bounded:
        raise ValueError(f"the verifiers taskset {env_id!r} yields tasks forever: set data.env.num_train")
    try:
        return list(taskset if count is None else taskset.take(count))
    except Exception as error:  # noqa: BLE001 - the environment's own code: named, whatever it raises
        raise ValueError(f"the verifiers taskset {env_id!r} raised while loading its tasks: "
                         f"{describe_error(error)}") from None


def _prompt(task: Any, split: str, index: int, env_id: str) -> Prompt:
    """A task as a row: its prompt as messages to read, its data (ground_truth) for the episode to rebuild it."""
    data = task.data.model_dump(mode="json", exclude_defaults=True)
    return Prompt(id=f"{split}/{index:06d}", prompt=prompt_messages(task.data), data_source=env_id,
                  ground_truth=json.dumps({"split": split, "task": data}))


def prompt_messages(data: Any) -> tuple[dict[str, str], ...]:
    """The task's system prompt and prompt as chat messages (text only), as a reader of the run sees them."""
    vf = import_verifiers()
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages += [{"role": m.role, "content": vf.types.content_text(getattr(m, "content", None))}
                     for m in data.prompt or ()]
    return tuple(messages)


# ---- episodes (an agent worker) -------------------------------------------------------------------------------


def make_agent(options: dict[str, Any]) -> Any:
    """The episode function of env.kind=verifiers (agent_worker.BuiltinAgent's factory): options are
    {"env": env.options, "eval": data.env.eval}. The environment loads here, at the worker's start, so one that
    cannot load fails it, saying why."""
    return VerifiersEpisodes(options["env"], options.get("eval")).run


class VerifiersEpisodes:
    """One verifiers Env in this worker, serving (its interception server, shared tools) from the first episode."""

    def __init__(self, options: dict[str, Any], eval_overrides: dict[str, Any] | None) -> None:
        vf = import_verifiers()
        self.vf, self.config = vf, env_config(options)
        try:
            self.env = vf.load_environment(self.config)
        except Exception as error:  # noqa: BLE001 - the environment's own code: named, whatever it raises
            raise ValueError(f"the verifiers environment {self.config.env_id!r} raised while loading: "
                             f"{describe_error(error)}") from None
        self._check_runtimes()
        self.task_class = type(self.env.taskset).task_type()
        self.task_configs = {"train": self.config.taskset.task, "eval": self.config.taskset.task}
        if eval_overrides is not None:
            self.task_configs["eval"] = env_config(eval_options(options, eval_overrides)).taskset.task
        self._serving: Any = None
        self._opening = asyncio.Lock()

    def _check_runtimes(self) -> None:
        """An agent in Prime's sandboxes needs a Prime login (and a tunnel to reach it): without one, say so now.
        verifiers would raise SystemExit from inside its event loop's tasks, which no episode could contain."""
        from verifiers.v1.runtimes import runtime_is_local
        from verifiers.v1.utils.prime import ensure_prime_auth

        remote = [name for name, agent in self.config if isinstance(agent, self.vf.AgentConfig)
                  and not runtime_is_local(agent.runtime)]
        if remote:
            try:
                ensure_prime_auth()
            except SystemExit as stop:
                raise ValueError(f"the verifiers environment {self.config.env_id!r} runs its agent(s) {remote} in "
                                 f"Prime's sandboxes, and {stop}; or: {REMOTE_HINT}") from None

    async def run(self, client: Any, row: dict[str, Any]) -> dict[str, float]:
        """One episode of the row's task, its model calls relayed to the client's base URL; its reward."""
        await self._open()
        task = self.task(row)
        os.environ[KEY_VARIABLE] = client.api_key  # one key for every episode of the run
        context = self.vf.ModelContext(model=MODEL, client=self.vf.EvalClientConfig(
            base_url=str(client.base_url).rstrip("/"), api_key_var=KEY_VARIABLE))
        try:
            episode = await self.env.run_episode(task, context)
        finally:
            await self._release(context.client)
        return {"reward": episode_reward(episode, self.config.env_id)}

    def task(self, row: dict[str, Any]) -> Any:
        """The row's task, rebuilt from the data its ground_truth carries."""
        try:
            carried = json.loads(row["ground_truth"])
            split, data = carried["split"], self.task_class.data_type().model_validate(carried["task"])
            return self.task_class(data, self.task_configs[split])
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"row {row.get('id')!r} does not carry a task of {self.config.env_id!r} (its "
                             f"ground_truth: {str(row.get('ground_truth'))[:120]!r}): {error}") from None

    async def _open(self) -> None:
        async with self._opening:
            if self._serving is None:
                serving = self.env.serving()
                await serving.__aenter__()
                self._serving = serving  # held for the worker's life (the pool ends its process), or until close

    async def close(self) -> None:
        serving, self._serving = self._serving, None
        if serving is not None:
            await serving.__aexit__(None, None, None)

    async def _release(self, client_config: Any) -> None:
        """Close the episode's model client. verifiers keeps one per distinct endpoint config for as long as its
        interception server lives, and each episode has a base URL of its own: kept, they would pile up."""
        interception = getattr(self.env, "_interception", None)
        servers = getattr(interception, "servers", None) or ([interception] if interception is not None else [])
        key = client_config.model_dump_json()
        for server in servers:
            client = getattr(server, "clients", {}).pop(key, None)
            if client is not None:
                await client.close()


def episode_reward(episode: Any, env_id: str) -> float:
    """The episode's reward, its traces' mean; a failed episode, or a reward that is not a finite number, raises
    naming why (the agent pool ends the episode as agent_error)."""
    scores = {name: None if r is None else r.score for trace in episode.traces for name, r in trace.rewards.items()}
    if not episode.ok:
        raise RuntimeError(f"the verifiers environment {env_id!r} failed the episode: {_errors(episode)} (its "
                           f"rewards: {scores})")
    rewards = [trace.reward for trace in episode.traces]
    reward = sum(rewards) / len(rewards)
    if not math.isfinite(reward):
        raise ValueError(f"the verifiers environment {env_id!r} gave the reward {reward} (its rewards: {scores})")
    return float(reward)


def _errors(episode: Any) -> str:
    errors = [*episode.errors, *(e for trace in episode.traces for e in trace.errors)]
    if not errors:
        return "it ended without an error, not ok"
    return "; ".join(f"{e.type}: {e.message}"[:300] for e in _unique(errors))


def _unique(errors: Iterable[Any]) -> list[Any]:
    seen, kept = set(), []
    for error in errors:
        if (error.type, error.message) not in seen:
            seen.add((error.type, error.message))
            kept.append(error)
    return kept
