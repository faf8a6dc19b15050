"""openai_api.py: requests validated with 400s that name the field; responses and streams in OpenAI's shapes."""

import json

import pytest

from flashreinforce.endpoint import openai_api as api
from flashreinforce.endpoint.openai_api import APIError

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": USER, "n": 2}, "n"),
    ({"messages": USER, "top_logprobs": 3, "logprobs": True}, "top_logprobs"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": USER, "logit_bias": {"5": 10}}, "logit_bias"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "temperature": 3}, "temperature"),
    ({"messages": USER, "stop": [""]}, "stop"),
    ({"messages": USER, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
])
def test_a_chat_request_the_endpoint_cannot_honour_is_a_400_naming_the_field(body, param):
    with pytest.raises(APIError) as error:
        api.parse_request(api.ChatRequest, body)
    assert error.value.status == 400 and error.value.param == param
    assert error.value.body()["error"]["type"] == "invalid_request_error"


def test_unknown_fields_are_ignored_and_known_ones_read():
    request = api.parse_request(api.ChatRequest, {"messages": USER, "user": "u1", "store": False,
                                                  "parallel_tool_calls": True, "max_completion_tokens": 7,
                                                  "stop": "END", "future_field": {"x": 1}})
    assert request.budget() == 7 and request.stop_strings() == ("END",)


@pytest.mark.parametrize(("body", "param"), [({"prompt": ["a", "b"]}, "prompt"), ({"prompt": ""}, "prompt"),
                                            ({"prompt": "a", "logprobs": 2}, "logprobs"),
                                            ({"prompt": "a", "echo": True}, "echo")])
def test_a_completion_request_is_one_prompt_without_alternatives(body, param):
    with pytest.raises(APIError) as error:
        api.parse_request(api.CompletionRequest, body)
    assert error.value.param == param


def test_a_body_that_is_not_an_object_is_a_400():
    with pytest.raises(APIError, match="JSON object"):
        api.parse_request(api.ChatRequest, [1, 2])


def test_a_stream_carries_role_content_tool_calls_finish_and_usage_then_done():
    message = {"role": "assistant", "content": "hi",
               "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    whole = api.chat_completion("chatcmpl-1", "m", message, "tool_calls", (5, 3))
    chunks = api.chat_chunks(whole, include_usage=True)
    deltas = [c["choices"][0]["delta"] if c["choices"] else None for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "hi"}
    assert deltas[2]["tool_calls"][0]["index"] == 0 and deltas[2]["tool_calls"][0]["function"]["name"] == "f"
    assert chunks[3]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[4]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    lines = api.sse(chunks).decode().strip().split("\n\n")
    assert lines[-1] == "data: [DONE]" and json.loads(lines[0].removeprefix("data: "))["id"] == "chatcmpl-1"


def test_text_completion_logprobs_have_offsets():
    body = api.text_completion("cmpl-1", "m", "ab", "stop", (2, 2), logprobs=(["a", "b"], [-0.1, -0.2]))
    assert body["choices"][0]["logprobs"] == {"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2],
                                              "top_logprobs": None, "text_offset": [0, 1]}
