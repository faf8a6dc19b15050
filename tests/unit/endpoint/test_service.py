"""service.py's record of an episode beyond its calls: the tool calls the model's answers made, counted as an
environment counts its own (eval/tool_calls, the recipes' tool calls per episode)."""

import asyncio

from flashreinforce.endpoint.chat import HERMES_TEMPLATE
from flashreinforce.endpoint.service import Endpoint
from flashreinforce.types import Generation, SamplingParams

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


class Scripted:
    """A CallRunner that answers each call with the next of `replies` (text, then end of turn)."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self.tokenizer, self.replies = tokenizer, list(replies)

    def submit(self, call):
        ids = (*self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False), self.tokenizer.eos_token_id)
        future = asyncio.get_running_loop().create_future()
        future.set_result(Generation(call.request_id, call.prompt_ids, ids, (0.0,) * len(ids), (0,) * len(ids),
                                     (1,) * len(ids), "stop", call.params))
        return future


def test_an_episode_counts_the_tool_calls_its_answers_made(chat_tokenizer):
    call = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    runner = Scripted(chat_tokenizer, [f"{call}\n{call}", "<tool_call>not json</tool_call>", "5"])
    endpoint = Endpoint(chat_tokenizer, runner, model_name="m", max_context=1024, max_new_tokens=64,
                        chat_template=HERMES_TEMPLATE)
    episode = endpoint.open_episode("r", SamplingParams(max_new_tokens=64))
    messages = [{"role": "user", "content": "2+3?"}]

    async def three_calls():
        for _ in range(3):
            reply = await endpoint.chat(episode.id, {"model": "m", "messages": messages, "tools": TOOLS})
            messages.append(reply["choices"][0]["message"])
            messages.extend({"role": "tool", "tool_call_id": c["id"], "content": "5"}
                            for c in reply["choices"][0]["message"].get("tool_calls") or ())
            if not reply["choices"][0]["message"].get("tool_calls"):
                messages.append({"role": "user", "content": "sure?"})
        await endpoint.complete(episode.id, {"model": "m", "prompt": "plain text"})

    runner.replies.append("more")
    asyncio.run(three_calls())
    assert len(episode.calls) == 4 and episode.tool_calls == 2  # a block that does not parse is no call
