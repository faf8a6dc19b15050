"""The endpoint's work between HTTP and the engine: render a request, record the call in its episode, answer it.

An episode (EndpointEpisode) is the record of one agent episode's calls: each call's prompt ids as rendered, the
engine's generation (sampled ids, behavior log-probs, versions). A call that repeats an earlier call's messages
and answer continues that call's row token for token (ChatRenderer.suffix; record.stitch decides the segments
from the ids alone). Calls outside an episode (`/v1/...`) are served by the same engine and recorded nowhere.

Replay: an episode reopened from a checkpoint (or after an abort) holds its recorded calls; the re-run agent's
requests that render to a recorded call (record.fingerprint) are answered from it, a recorded partial continues in
the engine, and the first request that renders to none ends the replay (counted: the agent is not deterministic
in its row and the answers it got). Calls reach the engine through a CallRunner: the run's episode machinery, or
EngineCalls over a bare AsyncEngine.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from flashreinforce.endpoint import openai_api as api
from flashreinforce.endpoint.chat import ChatRenderer, TemplateMessage, openai_message, same_answer, template_messages
from flashreinforce.endpoint.openai_api import APIError
from flashreinforce.endpoint.record import fingerprint, row_of
from flashreinforce.types import CallRecord, Generation, SamplingParams


@dataclass(frozen=True)
class Call:
    """A call on its way to the engine."""

    request_id: str
    """<episode request id>@<index>; serve-<n> outside an episode."""
    episode: str | None
    """The episode's request id (the loop's), None outside an episode."""
    index: int
    fingerprint: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    prefix: Generation | None = None
    """A recorded partial the call continues (a replayed episode's call that a pause caught in flight)."""
    messages: tuple[TemplateMessage, ...] = ()
    """A chat call's conversation as the template read it, and its tools: what a runner that answers without a
    model (a warm start's demonstrations) answers from."""
    tools: tuple[dict[str, Any], ...] = ()


class CallRunner(Protocol):
    def submit(self, call: Call) -> asyncio.Future:
        """Start the call in the engine; the future resolves with its Generation (finish_reason "abort" when the
        call was cancelled: its episode ended or was aborted)."""
        ...


@dataclass
class Head:
    """The tip of a segment: the latest call in it and what a request must repeat to continue it."""

    row: tuple[int, ...]
    """Its prompt ids and sampled ids."""
    turn_ids: tuple[int, ...]
    messages: tuple[TemplateMessage, ...] | None = None
    answer: TemplateMessage | None = None
    tools: str = "null"
    text: str | None = None
    """Completions: the prompt text and the completion's text (None after a turn that ended on EOS)."""


@dataclass
class EndpointEpisode:
    id: str
    """What its base URL names: /episodes/<id>/v1."""
    request_id: str
    params: SamplingParams
    """Its sampling (seeded); a call's seed derives from it and the call's index."""
    replay: list[CallRecord] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    """Calls that returned, in the order they did."""
    tool_calls: int = 0
    """Tool calls read back from the model's answers (an agent's tool use, as an environment counts its own)."""
    heads: list[Head] = field(default_factory=list)
    next_index: int = 0

    def take_replay(self, digest: str) -> CallRecord | None:
        """The recorded call this request renders to; the first request that renders to none ends the replay."""
        for k, record in enumerate(self.replay):
            if record.fingerprint == digest:
                return self.replay.pop(k)
        return None


def call_seed(params: SamplingParams, index: int, requested: int | None) -> int:
    """A call's sampling seed: its episode's seed, its index and the request's own seed (so G rollouts of one
    prompt still differ when an agent fixes `seed`)."""
    text = f"{params.seed}/{index}/{requested}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


class Endpoint:
    """Renders, records and answers OpenAI requests over a CallRunner."""

    def __init__(self, tokenizer: Any, runner: CallRunner | None, *, model_name: str, max_context: int,
                 max_new_tokens: int, chat_template: str | None = None, max_pending: int = 1024) -> None:
        """runner: how calls reach the engine (None until the run's episode machinery takes the endpoint)."""
        self.tokenizer, self.runner, self.model_name = tokenizer, runner, model_name
        self.max_context, self.max_new_tokens, self.max_pending = max_context, max_new_tokens, max_pending
        self.renderer = ChatRenderer(tokenizer, chat_template)
        self.episodes: dict[str, EndpointEpisode] = {}
        self._opened = 0
        self._served = 0
        self.pending = 0
        self.counts: Counter[str] = Counter()

    # ---- episodes -------------------------------------------------------------------------------------------

    def open_episode(self, request_id: str, params: SamplingParams,
                     replay: Sequence[CallRecord] = ()) -> EndpointEpisode:
        episode = EndpointEpisode(f"ep{self._opened}", request_id, params, replay=list(replay))
        self._opened += 1
        self.episodes[episode.id] = episode
        return episode

    def close_episode(self, episode_id: str) -> EndpointEpisode:
        """Later requests to it get a 410; its unused replay is counted."""
        episode = self.episodes.pop(episode_id)
        self.counts["replay_unused"] += len(episode.replay)
        return episode

    def episode(self, episode_id: str | None) -> EndpointEpisode | None:
        if episode_id is None:
            return None
        episode = self.episodes.get(episode_id)
        if episode is not None:
            return episode
        if episode_id.startswith("ep") and episode_id[2:].isdigit() and int(episode_id[2:]) < self._opened:
            raise APIError(410, f"episode {episode_id} has ended; its calls are recorded and no more are taken",
                           code="episode_ended")
        raise APIError(404, f"no episode {episode_id}: use the base URL the run gave the agent",
                       code="episode_not_found")

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "flashreinforce"}]}

    # ---- requests ---------------------------------------------------------------------------------------------

    async def chat(self, episode_id: str | None, body: Any) -> dict[str, Any]:
        """A chat.completion for the request (or an APIError)."""
        episode = self.episode(episode_id)
        request = api.parse_request(api.ChatRequest, body)
        messages, tools = template_messages(request.messages), request.rendered_tools()
        self.renderer.check_tools(tools)
        tools_key = json.dumps(tools, sort_keys=True)
        prompt_ids, head = self._chat_prompt(episode, messages, tools, tools_key)
        generation, index = await self._run(episode, "chat", prompt_ids, request, request.budget(),
                                            (tuple(messages), tuple(tools or ())))
        name = f"{episode.request_id if episode else 'serve'}@{index}"
        answer, reason = self.renderer.answer(generation.token_ids, request.stop_strings(), name, bool(tools))
        if episode is not None:
            self._advance(episode, head, Head(row_of(generation), generation.token_ids, tuple(messages), answer,
                                              tools_key))
            episode.tool_calls += len(answer.get("tool_calls") or ())
        finish = "length" if generation.finish_reason == "length" else reason
        logprobs = (api.token_logprobs(self.renderer.pieces(generation.token_ids), generation.behavior_logprobs)
                    if request.logprobs else None)
        ids = (generation.prompt_ids, generation.token_ids) if request.return_token_ids else None
        return api.chat_completion(f"chatcmpl-{name}", self.model_name, openai_message(answer), finish,
                                   (len(generation.prompt_ids), len(generation.token_ids)), logprobs, ids)

    async def complete(self, episode_id: str | None, body: Any) -> dict[str, Any]:
        """A text_completion for the request (or an APIError)."""
        episode = self.episode(episode_id)
        request = api.parse_request(api.CompletionRequest, body)
        prompt_ids, head = self._text_prompt(episode, request.prompt)
        generation, index = await self._run(episode, "completions", prompt_ids, request, request.max_tokens)
        text = self.renderer.text(generation.token_ids, request.stop_strings())
        if episode is not None:
            ended = bool(generation.token_ids) and generation.token_ids[-1] in (self.tokenizer.eos_token_id,)
            prompt_text = request.prompt if isinstance(request.prompt, str) else None
            self._advance(episode, head, Head(row_of(generation), generation.token_ids,
                                              text=None if ended or prompt_text is None else prompt_text + text))
        finish = "length" if generation.finish_reason == "length" else "stop"
        logprobs = ((self.renderer.pieces(generation.token_ids), generation.behavior_logprobs)
                    if request.logprobs is not None else None)
        ids = (generation.prompt_ids, generation.token_ids) if request.return_token_ids else None
        name = f"{episode.request_id if episode else 'serve'}@{index}"
        return api.text_completion(f"cmpl-{name}", self.model_name, text, finish,
                                   (len(generation.prompt_ids), len(generation.token_ids)), logprobs, ids)

    # ---- rendering --------------------------------------------------------------------------------------------

    def _chat_prompt(self, episode: EndpointEpisode | None, messages: list[TemplateMessage],
                     tools: list[dict[str, Any]] | None, tools_key: str) -> tuple[list[int], Head | None]:
        """The prompt ids: a segment's row and the suffix for the new messages when the request repeats that
        segment's last call and answer, else the whole conversation rendered (a new segment)."""
        for head in reversed(episode.heads if episode is not None else ()):
            n = len(head.messages or ())
            if (head.messages is None or head.tools != tools_key or len(messages) <= n + 1
                    or tuple(messages[:n]) != head.messages or not same_answer(messages[n], head.answer)):
                continue
            suffix = self.renderer.suffix(messages[: n + 1], messages[n + 1:], tools, head.turn_ids)
            if suffix is None:
                self.counts["template_not_appendable"] += 1
                break
            return [*head.row, *suffix], head
        return self.renderer.render(messages, tools, generation_prompt=True), None

    def _text_prompt(self, episode: EndpointEpisode | None, prompt: str | list[int]) -> tuple[list[int], Head | None]:
        """Token ids as given, or the text tokenized; text that repeats a segment's prompt and completion keeps
        that row's ids and tokenizes only what follows."""
        if not isinstance(prompt, str):
            self._check_ids(prompt)
            return list(prompt), None
        for head in reversed(episode.heads if episode is not None else ()):
            if head.text is not None and prompt.startswith(head.text):
                rest = prompt[len(head.text):]
                return [*head.row, *self.tokenizer.encode(rest, add_special_tokens=False)], head
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        if not ids:
            raise APIError(400, "the prompt renders to no tokens", param="prompt")
        return ids, None

    def _check_ids(self, ids: Sequence[int]) -> None:
        vocabulary = len(self.tokenizer)
        bad = [t for t in ids if not 0 <= t < vocabulary]
        if bad:
            raise APIError(400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocabulary})",
                           param="prompt")

    @staticmethod
    def _advance(episode: EndpointEpisode, head: Head | None, new: Head) -> None:
        if head is not None and head in episode.heads:
            episode.heads.remove(head)
        episode.heads.append(new)

    # ---- the engine -------------------------------------------------------------------------------------------

    def _params(self, episode: EndpointEpisode | None, request: Any, prompt_ids: list[int], budget: int | None,
                index: int) -> SamplingParams:
        """An episode's call samples as its episode does (the trainer recomputes at that temperature), with the
        request's budget and stop strings; a call outside an episode as the request asks."""
        if len(prompt_ids) >= self.max_context:
            raise APIError(400, f"the prompt is {len(prompt_ids)} tokens and the context holds {self.max_context} "
                           "(prompt and completion together); shorten the conversation", param="messages",
                           code="context_length_exceeded")
        stops = request.stop_strings()
        for stop in stops:
            if self.tokenizer.decode(self.tokenizer.encode(stop, add_special_tokens=False)) != stop:
                raise APIError(400, f"stop string {stop!r} cannot be produced by the model's tokenizer", param="stop")
        cap = episode.params.max_new_tokens if episode is not None else self.max_new_tokens  # the task's budget
        room = min(budget or cap, cap, self.max_context - len(prompt_ids))
        if episode is None:
            return SamplingParams(max_new_tokens=room, temperature=1.0 if request.temperature is None
                                  else request.temperature, top_p=request.top_p or 1.0, seed=request.seed,
                                  stop_strings=stops)
        base = episode.params
        if request.temperature not in (None, base.temperature) or request.top_p not in (None, base.top_p):
            self.counts["sampling_overridden"] += 1  # the run's sampling is what the trainer recomputes
        return replace(base, max_new_tokens=room, stop_strings=stops, seed=call_seed(base, index, request.seed))

    async def _run(self, episode: EndpointEpisode | None, api_name: str, prompt_ids: list[int], request: Any,
                   budget: int | None, conversation: tuple[tuple, tuple] = ((), ())) -> tuple[Generation, int]:
        """The call's generation: from the episode's replay, or from the engine; and its index. `conversation`: a
        chat call's messages and tools, for the Call."""
        if self.pending >= self.max_pending:
            self.counts["rate_limited"] += 1
            raise APIError(429, f"{self.pending} calls are waiting for the engine; retry later",
                           kind="requests", code="rate_limit_exceeded")
        index = episode.next_index if episode is not None else self._served
        params = self._params(episode, request, prompt_ids, budget, index)
        digest = fingerprint(api_name, prompt_ids, params)
        record = episode.take_replay(digest) if episode is not None else None
        if episode is not None and record is None and episode.replay:
            self.counts["replay_diverged"] += 1  # the agent asked something its record does not hold
            self.counts["replay_unused"] += len(episode.replay)
            episode.replay.clear()
        if record is not None:
            index = record.index
            self.counts["replayed"] += 1
        if episode is not None:
            episode.next_index = max(episode.next_index, index + 1)
        else:
            self._served += 1
        if record is not None and record.generation.finish_reason != "abort":
            generation = record.generation
        else:
            call = Call(f"{episode.request_id}@{index}" if episode else f"serve-{index}",
                        episode.request_id if episode else None, index, digest, tuple(prompt_ids),
                        record.generation.params if record else params, record.generation if record else None,
                        *conversation)
            generation = await self._engine(call)
        if episode is not None:
            episode.calls.append(CallRecord(index, digest, generation))
        self.counts["calls"] += 1
        return generation, index

    async def _engine(self, call: Call) -> Generation:
        """The call's generation from the engine; a 410 when its episode ended (or was aborted) meanwhile."""
        self.pending += 1  # calls waiting for the engine: past max_pending, requests are answered 429
        try:
            generation = await self.runner.submit(call)
        finally:
            self.pending -= 1
        if generation.finish_reason == "abort":
            raise APIError(410, f"the episode of call {call.request_id} ended while the call ran",
                           code="episode_ended")
        return generation


class EngineCalls:
    """A CallRunner straight over an AsyncEngine (serving without a run, and tests)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def submit(self, call: Call) -> asyncio.Future:
        return self.engine.submit(call.request_id, call.prompt_ids, call.params, prefix=call.prefix)
