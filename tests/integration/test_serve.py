"""`flashreinforce serve`: a saved model behind the OpenAI API in a process of its own, for the plain `openai`
client: its chat template (or --chat-template) renders tools, a wrong key is refused, SIGTERM stops it cleanly."""

from __future__ import annotations

import asyncio

import pytest

from serving import served

pytestmark = [pytest.mark.slow, pytest.mark.endpoint]

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


async def ask(base_url: str, key: str, **extra) -> object:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as client:
        return await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "2+3?"}],
                                                    max_tokens=4, **extra)


@pytest.fixture
def long_chat_model(chat_tokenizer, tmp_path):
    """The conftest's chat model with room for the Hermes tools block (1,024 positions)."""
    from flashreinforce.models import build_model

    directory = tmp_path / "chat-model"
    build_model(len(chat_tokenizer), 32, 1, 2, 1024, intermediate_size=128, pad_token_id=chat_tokenizer.pad_token_id,
                eos_token_id=chat_tokenizer.eos_token_id).save_pretrained(directory)
    chat_tokenizer.save_pretrained(directory)
    return directory


def test_a_model_directory_is_served_to_the_openai_client(long_chat_model):
    import openai

    model_dir = long_chat_model
    with served(model_dir, "--api-key", "k", "--chat-template", "hermes") as (url, _):
        reply = asyncio.run(ask(url, "k", tools=TOOLS, logprobs=True))
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls") and reply.usage.prompt_tokens > 0
        assert reply.model == model_dir.name
        with pytest.raises(openai.AuthenticationError):
            asyncio.run(ask(url, "wrong"))


def test_without_a_tool_format_tools_are_refused_naming_the_fix(save_chat_model):
    import openai

    with served(save_chat_model(32, 1), "--api-key", "k") as (url, _):  # the test model's template has no tools
        with pytest.raises(openai.BadRequestError, match="chat_template=hermes"):
            asyncio.run(ask(url, "k", tools=TOOLS))
        assert asyncio.run(ask(url, "k")).choices  # and it goes on serving
