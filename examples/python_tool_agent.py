"""An ordinary function-calling agent with one tool, written against the `openai` client only: it asks the model a
product of two numbers, runs the Python the model writes in flashreinforce's sandbox, hands the output back as a
tool message, and takes the model's final reply as its answer.

flashreinforce trains this file as it is (`flashreinforce train smollm2_agent`, env.agent=...:run); on its own it
asks any OpenAI-compatible server, e.g. the trained model served by `flashreinforce serve RUN_DIR`:

    python examples/python_tool_agent.py --base-url http://127.0.0.1:8000/v1 --api-key KEY --questions 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import threading

from flashreinforce.sandbox import Sandbox, SandboxLimits

SYSTEM = "Compute with the python tool. End with 'answer: ' and the number."
TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code; returns what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]
MAX_CALLS = 3
"""Model calls per question: after this many the agent gives up (no answer)."""

_sandbox: Sandbox | None = None
_sandbox_lock = threading.Lock()


def run_python(code: str) -> str:
    """What `code` prints, run in a fresh isolated process (bubblewrap, else unshare; never unisolated)."""
    global _sandbox
    with _sandbox_lock:  # one warm sandbox per process, made by the first call
        if _sandbox is None:
            _sandbox = Sandbox(SandboxLimits(wall_s=5.0, output_bytes=1024))
    result = _sandbox.run(code)
    if result.timed_out:
        return result.output + "\n[timed out]"
    if result.exit_code != 0:
        return result.output + f"\n[exit code {result.exit_code}]"
    return result.output.strip() or "[no output]"


def tool_result(arguments: str) -> str:
    try:
        code = json.loads(arguments)["code"]
    except (ValueError, KeyError, TypeError):
        return 'error: call python with {"code": "<python source>"}'
    return run_python(str(code))


async def solve(client, question: str, model: str = "policy") -> str:
    """The model's final reply to `question`, after as many tool calls as it makes (up to MAX_CALLS - 1)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=64)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            output = await asyncio.to_thread(tool_result, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return ""


def question(row: dict) -> str:
    """A row of flashreinforce's tool_multiply data (`{"prompt": "123*456=", ...}`) as the user's question."""
    return f"What is {row['prompt'].removesuffix('=')}?"


async def run(client, row: dict) -> dict:
    """flashreinforce's entry (env.agent): the task's verifier scores the answer (`answer: N`)."""
    return {"answer": await solve(client, question(row))}


ANSWER = re.compile(r"answer:\s*(-?\d+)")


async def ask(client, model: str, a: int, b: int) -> bool:
    reply = await solve(client, question({"prompt": f"{a}*{b}="}), model)
    found = ANSWER.search(reply)
    print(f"{a}*{b}: {reply!r}")
    return found is not None and int(found.group(1)) == a * b


async def main() -> None:
    import openai

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the server's OpenAI base URL, e.g. http://HOST:PORT/v1")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    parser.add_argument("--model", default="policy", help="the model name the server expects")
    parser.add_argument("--questions", type=int, default=32, help="random products of two 2-3 digit numbers")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    pairs = [(rng.randint(10, 999), rng.randint(10, 999)) for _ in range(args.questions)]
    async with openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key) as client:
        right = await asyncio.gather(*(ask(client, args.model, a, b) for a, b in pairs))
    print(f"correct: {sum(right)}/{len(right)}")


if __name__ == "__main__":
    asyncio.run(main())
