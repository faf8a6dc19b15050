"""The HTTP door: aiohttp serving an Endpoint on the run's event loop (the `endpoint` extra).

    GET  /v1/models                         POST /v1/chat/completions        POST /v1/completions
    GET  /episodes/<id>/v1/models           POST /episodes/<id>/v1/chat/completions ...
    GET  /health                            (no key needed)

Every route but /health needs `Authorization: Bearer <key>` (the run's own key, made per run unless set). It binds
127.0.0.1 unless endpoint.host says otherwise. A bad request (malformed JSON, an unknown route or episode, a body
over the size limit, a wrong key) is answered 4xx with an OpenAI error body and touches nothing else; an error of
the endpoint itself is a 500 with a body, counted, and the run goes on. A streamed response (stream=true) is sent
as server-sent events once the call ends: the engine hands a call back whole.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
from typing import Any

from aiohttp import web

from flashreinforce.endpoint import openai_api as api
from flashreinforce.endpoint.openai_api import APIError
from flashreinforce.endpoint.service import Endpoint

MAX_BODY_BYTES = 16 * 2**20
"""A request body larger than this is a 413 (the context bounds what a request can use anyway)."""

_log = logging.getLogger(__name__)


class EndpointServer:
    """Serves `endpoint` at http://host:port; start() binds (port 0: a free one), stop() closes."""

    def __init__(self, endpoint: Endpoint, *, api_key: str, host: str = "127.0.0.1", port: int = 0) -> None:
        if not api_key:
            raise ValueError("the endpoint needs an API key (endpoint.api_key, or none set for one made per run)")
        self.endpoint, self.api_key, self.host, self.port = endpoint, api_key, host, port
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def base_url(self, episode_id: str | None = None) -> str:
        """The OpenAI base URL of an episode (or of calls outside any episode)."""
        return f"{self.url}/episodes/{episode_id}/v1" if episode_id is not None else f"{self.url}/v1"

    async def start(self) -> None:
        app = web.Application(middlewares=[self._errors], client_max_size=MAX_BODY_BYTES)
        for prefix in ("/v1", "/episodes/{episode}/v1"):
            app.router.add_get(f"{prefix}/models", self._models)
            app.router.add_post(f"{prefix}/chat/completions", self._chat)
            app.router.add_post(f"{prefix}/completions", self._complete)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=2048)
        await site.start()
        sockets = [s for s in site._server.sockets if s.family in (socket.AF_INET, socket.AF_INET6)]
        self.port = sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- handlers -------------------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        self.endpoint.episode(request.match_info.get("episode"))  # 404 / 410 for a wrong episode
        return web.json_response(self.endpoint.models())

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        reply = await self.endpoint.chat(request.match_info.get("episode"), body)
        return await _answer(request, body, reply, api.chat_chunks)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        reply = await self.endpoint.complete(request.match_info.get("episode"), body)
        return await _answer(request, body, reply, api.text_chunks)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The key check, and every failure as an OpenAI error body."""
        counts = self.endpoint.counts
        try:
            if request.path != "/health" and not self._authorized(request):
                raise APIError(401, "wrong or missing API key: send `Authorization: Bearer <key>` with the run's "
                               "key (endpoint.json in the run directory)", code="invalid_api_key")
            return await handler(request)
        except APIError as error:
            counts[f"errors/{error.status}"] += 1
            return web.json_response(error.body(), status=error.status)
        except web.HTTPException as error:  # no such route (404), method (405), a body over the limit (413)
            counts[f"errors/{error.status}"] += 1
            message = f"{error.reason}: {request.method} {request.path}"
            if error.status == 413:
                message = f"the request body is over {MAX_BODY_BYTES} bytes"
            return web.json_response(APIError(error.status, message).body(), status=error.status)
        except Exception as error:  # noqa: BLE001 - an endpoint bug answers 500; the run goes on
            counts["errors/500"] += 1
            _log.exception("endpoint error on %s %s", request.method, request.path)
            body = APIError(500, f"{type(error).__name__}: {error}", kind="server_error").body()
            return web.json_response(body, status=500)

    def _authorized(self, request: web.Request) -> bool:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), self.api_key.encode())


async def _json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the request body is not valid JSON ({error})", code="invalid_json") from None


async def _answer(request: web.Request, body: Any, reply: dict[str, Any], chunks: Any) -> web.StreamResponse:
    """The reply as JSON, or as server-sent events when the request asked to stream."""
    if not body.get("stream"):
        return web.json_response(reply)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    await response.write(api.sse(chunks(reply, include_usage)))
    await response.write_eof()
    return response
