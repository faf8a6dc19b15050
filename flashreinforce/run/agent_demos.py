"""Warm-start demonstrations for an agent of the user's own (env.kind=agent): the agent itself, run through the
endpoint, its calls answered by the task's demonstrator instead of the policy.

The agent builds its own conversation (its system prompt, its tools, how tool results come back), so no trace
written apart from it could render as its calls do. Instead the agent runs as during RL: each call is rendered by
the endpoint with the run's chat template (endpoint.chat_template), the task's demonstrator (run/tasks.py, e.g.
tool_multiply's: call the code tool or guess, then answer the tool's output) picks the assistant message, and the
call is answered with the ids the template writes for that message (tool calls in the template's own format,
which the endpoint parses back). The agent's tools run for real (a code tool in its sandbox), and the episode's
calls are stitched into rows as RL stitches them (endpoint/record.py): SFT trains exactly the rows RL samples,
the demonstrated turns as targets, the prompt and the tool results not.
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections import Counter
from collections.abc import Sequence
from typing import Any

from flashreinforce.config import RunConfig
from flashreinforce.controller.agent_episodes import agent_row
from flashreinforce.endpoint.chat import ChatRenderer
from flashreinforce.endpoint.openai_api import APIError
from flashreinforce.endpoint.record import stitch
from flashreinforce.endpoint.service import Call, Endpoint
from flashreinforce.envs.agents import AgentPool
from flashreinforce.run.endpoint import chat_template, check_endpoint, model_name
from flashreinforce.run.tasks import Demonstrate, Example
from flashreinforce.types import Generation, Prompt, SamplingParams

CONCURRENT_EPISODES = 16
"""Episodes run at once: a demonstration takes no model time, so a few workers' worth keeps the agents busy."""


class Demonstrations:
    """A CallRunner that answers each chat call of an episode with the demonstrator's message, as sampled ids."""

    def __init__(self, config: RunConfig, renderer: ChatRenderer, demonstrate: Demonstrate) -> None:
        self.config, self.renderer, self.demonstrate = config, renderer, demonstrate
        self.episodes: dict[str, tuple[Prompt, random.Random]] = {}
        """Each episode's prompt and generator, by its request id."""
        self.error: Exception | None = None
        """The first demonstration that could not be written: the warm start stops with it."""

    def submit(self, call: Call) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        try:
            future.set_result(self._answer(call))
        except Exception as error:  # noqa: BLE001 - kept for the warm start to raise; the agent sees a failed call
            self.error = self.error or error
            future.set_exception(APIError(500, f"no demonstration: {error}", kind="server_error"))
        return future

    def _answer(self, call: Call) -> Generation:
        if call.episode is None or not call.messages:
            raise ValueError("demonstrations answer the chat calls of an agent's episodes; the agent called "
                             "/v1/completions or outside its episode")
        prompt, rng = self.episodes[call.episode]
        message = self.demonstrate(self.config, prompt, call.messages, call.tools, rng)
        ids = tuple(self.renderer.written_turn(list(call.messages), message, list(call.tools) or None))
        if len(ids) > call.params.max_new_tokens:
            raise ValueError(f"a demonstrated turn is {len(ids)} tokens, over its call's budget of "
                             f"{call.params.max_new_tokens} (rollout.max_new_tokens, the agent's max_tokens, or what "
                             f"the context leaves): the policy could never sample it; raise the budget")
        return Generation(request_id=call.request_id, prompt_ids=call.prompt_ids, token_ids=ids,
                          behavior_logprobs=(0.0,) * len(ids), policy_versions=(0,) * len(ids),
                          loss_mask=(1,) * len(ids), finish_reason="stop", params=call.params)


def agent_examples(config: RunConfig, tokenizer: Any, train: Sequence[Prompt], demonstrate: Demonstrate,
                   model_context: int | None) -> list[Example]:
    """SFT rows (prompt ids, completion ids, target mask) of one agent task (config: the task's own): its agent run
    on the first sft.steps x sft.batch_size train prompts (each drawn about once), answered by `demonstrate`. An
    episode whose agent fails is left out, counted in the error raised when none ends well."""
    check_endpoint(config)
    room = config.env.max_prompt_tokens  # the context RL gives the agent's calls, else what the model holds
    context = room + config.rollout.max_new_tokens if room is not None else model_context
    prompts = list(train[: config.sft.steps * config.sft.batch_size])
    rows, failures = asyncio.run(_run_episodes(config, tokenizer, prompts, demonstrate, context or 1 << 20))
    if not rows:
        reasons = "; ".join(f"{count} x {reason}" for reason, count in failures.most_common(3))
        raise ValueError(f"env.agent={config.env.agent}: no demonstration episode ended well: {reasons}")
    return rows


def agent_template(config: RunConfig) -> str | None:
    """The chat template an agent warm start rendered its demonstrations with (endpoint.chat_template), which the
    warmed model keeps so that any later client of it gets the same rendering; None: the tokenizer's own, or a
    run without agent tasks."""
    if not any(task.env.is_agent for _, task in config.task_list()):
        return None
    return chat_template(config)


async def _run_episodes(config: RunConfig, tokenizer: Any, prompts: Sequence[Prompt], demonstrate: Demonstrate,
                        max_context: int) -> tuple[list[Example], Counter[str]]:
    from flashreinforce.endpoint.server import EndpointServer  # the endpoint extra, checked by the caller

    endpoint = Endpoint(tokenizer, None, model_name=model_name(config), max_context=max_context,
                        max_new_tokens=config.rollout.max_new_tokens, chat_template=chat_template(config))
    runner = Demonstrations(config, endpoint.renderer, demonstrate)
    endpoint.runner = runner
    server = EndpointServer(endpoint, api_key=secrets.token_urlsafe(24))
    env = config.env
    pool = AgentPool({task: env.agent for task in {p.task for p in prompts}}, timeout_s=env.agent_timeout_s,
                     min_workers=env.min_workers, max_workers=max(env.min_workers, env.max_workers))
    rows: list[list[Example]] = [[] for _ in prompts]
    failures: Counter[str] = Counter()
    slots = asyncio.Semaphore(CONCURRENT_EPISODES)

    async def episode(k: int, prompt: Prompt) -> None:
        async with slots:
            request_id = f"demo-{k}"
            runner.episodes[request_id] = (prompt, random.Random(f"{config.seed}/{prompt.id}"))
            opened = endpoint.open_episode(request_id, SamplingParams(max_new_tokens=config.rollout.max_new_tokens))
            outcome = await pool.run(opened.id, agent_row(prompt), server.base_url(opened.id), server.api_key)
            segments, _ = stitch(endpoint.close_episode(opened.id).calls)
            if outcome.failure is not None or not segments:
                failures[(outcome.failure or "agent_no_calls")[:300]] += 1
                return
            rows[k] = [(list(s.prompt_ids), list(s.token_ids), list(s.loss_mask)) for s in segments]

    try:
        await server.start()
        await pool.start()
        await asyncio.gather(*(episode(k, prompt) for k, prompt in enumerate(prompts)))
    finally:
        await pool.aclose()
        await server.stop()
    if runner.error is not None:
        raise runner.error
    return [row for episode_rows in rows for row in episode_rows], failures
