"""The OpenAI wire format: requests validated into small records, errors and responses as OpenAI writes them.

Requests are checked here, before anything reaches the engine: a field the endpoint cannot honour exactly (n > 1,
top_logprobs > 0, a forced tool choice, penalties, images) is a 400 naming the field, never silently dropped.
Fields the OpenAI API has and that change nothing here (user, metadata, store, parallel_tool_calls...) are
accepted and ignored, so that unmodified clients work. Nothing here knows about episodes or engines.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class APIError(Exception):
    """A request the endpoint refuses: an HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Lenient(BaseModel):
    """Unknown fields are accepted and ignored: clients send fields of newer API versions."""

    model_config = ConfigDict(extra="ignore")


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as text; a part that is not text (an image, audio) is refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"a {self.role} message has a content part of type {part.type!r}; the endpoint "
                               "reads text parts only", param="messages", code="unsupported_content")
        return "".join(part.text for part in self.content)


class FunctionSpec(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Sampling(_Lenient):
    model: str = ""
    """Ignored: the endpoint serves one model, the policy (/v1/models names it)."""
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False
    """vLLM's extension: the response also carries prompt_token_ids and each choice's token_ids."""

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 16 or not all(stops):
            raise ValueError("at most 16 non-empty stop strings")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def check_supported(self) -> None:
        """What the endpoint cannot do exactly is refused, naming the field."""
        if self.n != 1:
            raise APIError(400, f"n={self.n}: the endpoint answers one choice per request (send n requests)",
                           param="n", code="unsupported_parameter")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name}={getattr(self, name)}: penalties are not supported (the behavior "
                               "log-probs must be the sampled distribution's); leave it at 0", param=name,
                               code="unsupported_parameter")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_parameter")


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs:
            raise APIError(400, f"top_logprobs={self.top_logprobs}: only the sampled tokens' log-probs are returned "
                           "(logprobs=true, top_logprobs 0)", param="top_logprobs", code="unsupported_parameter")
        if self.tool_choice not in (None, "auto", "none"):
            raise APIError(400, f"tool_choice={self.tool_choice!r}: the endpoint cannot force a tool call; use "
                           "'auto' (or 'none')", param="tool_choice", code="unsupported_parameter")
        if self.response_format not in (None, {"type": "text"}):
            raise APIError(400, "response_format: only {'type': 'text'} (constrained decoding would change the "
                           "sampled distribution)", param="response_format", code="unsupported_parameter")

    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def rendered_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template receives them (None: none, or tool_choice 'none')."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and not all(isinstance(t, int) for t in value):
            raise ValueError("one prompt per request: a string or a list of token ids")
        if not value:
            raise ValueError("the prompt is empty")
        return value

    def check_supported(self) -> None:
        super().check_supported()
        for name, ok in (("logprobs", not self.logprobs), ("echo", not self.echo), ("suffix", self.suffix is None),
                         ("best_of", self.best_of in (None, 1))):
            if not ok:
                raise APIError(400, f"{name}={getattr(self, name)!r} is not supported (logprobs: 0 returns the "
                               "sampled tokens' log-probs)", param=name, code="unsupported_parameter")


def parse_request(cls: type[_Sampling], body: Any) -> Any:
    """A validated request, or a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        request = cls.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or None
        raise APIError(400, f"{where}: {first['msg'].removeprefix('Value error, ')}", param=where) from None
    request.check_supported()
    return request


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_logprobs(pieces: Sequence[str], logprobs: Sequence[float]) -> dict[str, Any]:
    """Chat logprobs: each sampled token with its behavior log-prob (no alternatives)."""
    return {"content": [{"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}
                        for piece, lp in zip(pieces, logprobs)]}


def chat_completion(response_id: str, model: str, message: dict[str, Any], finish_reason: str,
                    counts: tuple[int, int], logprobs: dict[str, Any] | None = None,
                    token_ids: tuple[Sequence[int], Sequence[int]] | None = None) -> dict[str, Any]:
    """A whole chat.completion object. `token_ids`: (prompt ids, sampled ids) for return_token_ids."""
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    body: dict[str, Any] = {"id": response_id, "object": "chat.completion", "created": int(time.time()),
                            "model": model, "choices": [choice], "usage": usage(*counts)}
    if token_ids is not None:
        body["prompt_token_ids"], choice["token_ids"] = list(token_ids[0]), list(token_ids[1])
    return body


def chat_chunks(whole: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A chat.completion as the chat.completion.chunk objects of a stream: the role, the content, each tool call,
    the finish reason, and the usage when asked."""
    choice, message = whole["choices"][0], whole["choices"][0]["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"id": whole["id"], "object": "chat.completion.chunk", "created": whole["created"],
                "model": whole["model"], "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                      "finish_reason": finish, **extra}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}))
        chunks[-1]["choices"][0]["logprobs"] = choice["logprobs"]
    for index, call in enumerate(message.get("tool_calls") or ()):
        chunks.append(chunk({"tool_calls": [{"index": index, **call}]}))
    chunks.append(chunk({}, choice["finish_reason"],
                        **({"token_ids": choice["token_ids"]} if "token_ids" in choice else {})))
    if include_usage:
        chunks.append({**{k: v for k, v in chunks[0].items() if k != "choices"}, "choices": [],
                       "usage": whole["usage"]})
    return chunks


def text_completion(response_id: str, model: str, text: str, finish_reason: str, counts: tuple[int, int],
                    logprobs: tuple[Sequence[str], Sequence[float]] | None = None,
                    token_ids: tuple[Sequence[int], Sequence[int]] | None = None) -> dict[str, Any]:
    """A text_completion object (the legacy completions API)."""
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if logprobs is not None:
        pieces, values = logprobs
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        choice["logprobs"] = {"tokens": list(pieces), "token_logprobs": list(values), "top_logprobs": None,
                              "text_offset": offsets}
    body: dict[str, Any] = {"id": response_id, "object": "text_completion", "created": int(time.time()),
                            "model": model, "choices": [choice], "usage": usage(*counts)}
    if token_ids is not None:
        body["prompt_token_ids"], choice["token_ids"] = list(token_ids[0]), list(token_ids[1])
    return body


def text_chunks(whole: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A text_completion as a stream: its text, then its finish reason (and the usage when asked)."""
    choice = whole["choices"][0]
    head = {k: whole[k] for k in ("id", "object", "created", "model")}
    chunks = [{**head, "choices": [{**choice, "finish_reason": None}]},
              {**head, "choices": [{"index": 0, "text": "", "logprobs": None,
                                    "finish_reason": choice["finish_reason"]}]}]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": whole["usage"]})
    return chunks


def sse(chunks: Sequence[dict[str, Any]]) -> bytes:
    """Server-sent events, as OpenAI streams: one `data:` line per chunk, then `data: [DONE]`."""
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
