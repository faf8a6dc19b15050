"""A small `verifiers` environment that runs offline: sums of two numbers, a chat loop as its agent, an exact-match
rubric.

verifiers loads an environment by its taskset's id, the package name (here `vf_sums`, with this directory's parent
on PYTHONPATH). The package exports its Taskset (the tasks: a train and a test split) and a Harness (the agent that
plays them: it asks the model, and once more if the reply is not a bare number). The harness runs in-process and
calls the model only through the endpoint verifiers hands it, as every harness must, so training records every
call. The rubric is the task's `@vf.reward` function.

    PYTHONPATH=examples/hubs flashreinforce train env.kind=verifiers env.options.taskset.id=vf_sums ...
"""

from __future__ import annotations

import random
import re
from typing import Literal

import verifiers.v1 as vf
from openai import AsyncOpenAI

NUMBER = re.compile(r"-?\d+")


class SumsData(vf.TaskData):
    answer: str


class SumsTask(vf.Task[SumsData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: SumsData, trace: vf.Trace) -> float:
        """1 when the last reply's last number is the sum."""
        numbers = NUMBER.findall(trace.last_reply)
        return float(bool(numbers) and numbers[-1] == task.answer)


class SumsConfig(vf.TasksetConfig):
    split: Literal["train", "test"] = "train"
    size: int = 256
    max_operand: int = 20


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    def load(self):
        rng = random.Random(f"vf_sums/{self.config.split}")  # the two splits draw apart
        for _ in range(self.config.size):
            a, b = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
            data = SumsData(prompt=f"What is {a} + {b}? Reply with the number only.", answer=str(a + b))
            yield SumsTask(data, self.config.task)


class AskTwiceConfig(vf.HarnessConfig):
    max_calls: int = 2
    max_tokens: int = 16


class AskTwice(vf.Harness[AskTwiceConfig]):
    """The agent: asks, and asks again (the conversation continued) while the reply is not a bare number."""

    NEEDS_CONTAINER = False
    EXECUTES_CODE = False
    APPENDS_SYSTEM_PROMPT = True

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        text = ""
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for _ in range(self.config.max_calls):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                             max_tokens=self.config.max_tokens)
                text = reply.choices[0].message.content or ""
                if NUMBER.fullmatch(text.strip()):
                    break
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": "Reply with the number only."}]
        return vf.ProgramResult(0, text, "")


__all__ = ["AskTwice", "SumsConfig", "SumsTask", "SumsTaskset"]
