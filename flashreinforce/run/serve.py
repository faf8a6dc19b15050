"""`flashreinforce serve PATH`: a saved model behind the OpenAI-compatible endpoint, for any OpenAI client.

The model (a run directory's latest, a checkpoint, a Hugging Face directory, or a converted model's name) is served
by the embedded engine at /v1 (chat and text completions, models: docs/endpoint.md), on loopback with a key unless
told otherwise. Requests are rendered with the model's own chat template (an agent warm start saves the template it
trained with, so the agent that trained gets the same rendering) or --chat-template. Nothing is recorded or trained:
each call is served as a call outside any episode of a run is, with the request's own sampling.
"""

from __future__ import annotations

import asyncio
import importlib.util
import secrets
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashreinforce.config import config_from_tree
from flashreinforce.endpoint.service import Endpoint, EngineCalls
from flashreinforce.models.numerics import Numerics
from flashreinforce.rollout.async_engine import AsyncEngine
from flashreinforce.rollout.engine import Engine
from flashreinforce.run.devices import resolve_device
from flashreinforce.run.directory import read_run_config
from flashreinforce.run.endpoint import EXTRA_HINT, template_text
from flashreinforce.run.evaluation import resolve_model_dir
from flashreinforce.run.policy import Policy, load_policy, resolve_model_path


@dataclass(frozen=True)
class ServeRequest:
    path: str
    """A run directory, a checkpoints/step_* directory, a Hugging Face model directory or a converted model's name."""
    host: str = "127.0.0.1"
    port: int = 8000
    """0: a free one (ready's URL says which)."""
    api_key: str | None = None
    """None: a new one, handed to ready."""
    chat_template: str | None = None
    """None: the model's own; hermes, or a Jinja file (as endpoint.chat_template)."""
    max_context: int = 2048
    """Tokens of prompt and completion together per request (at most the model's positions)."""
    max_batch_size: int = 8
    precision: str | None = None
    """fp32 | bf16 | fp8; None: the run's rollout precision, fp32 for a model outside a run."""


def serve_model(request: ServeRequest, ready: Callable[[str, str], None]) -> None:
    """Serve until SIGINT or SIGTERM; ready(base_url, api_key) once the server listens."""
    if importlib.util.find_spec("aiohttp") is None:
        raise ValueError(f"flashreinforce serve needs aiohttp: {EXTRA_HINT}")
    template = template_text(request.chat_template, "--chat-template")
    model_dir, precision = served_model(request)
    policy = load_policy(model_dir)
    positions = getattr(policy.model.config, "max_position_embeddings", None)
    context = min(request.max_context, positions or request.max_context)
    engine = AsyncEngine(serving_engine(policy, context, request.max_batch_size, precision))
    endpoint = Endpoint(policy.tokenizer, EngineCalls(engine), model_name=Path(request.path).name,
                        max_context=context, max_new_tokens=context, chat_template=template)
    try:
        asyncio.run(_serve_until_stopped(endpoint, request, ready))
    finally:
        engine.close()


def served_model(request: ServeRequest) -> tuple[Path, str]:
    """The model directory, and the precision it is served in."""
    path = Path(request.path)
    if not path.exists():  # a converted model's name (one not converted: an error naming the command), a Hub id
        path = resolve_model_path(request.path)
    if not path.exists():
        raise ValueError(f"{request.path}: no such directory, and no model by that name (flashreinforce models list)")
    model_dir, run_dir = resolve_model_dir(path)
    run_precision = config_from_tree(read_run_config(run_dir)).precision.rollout if run_dir is not None else "fp32"
    return model_dir, request.precision or run_precision


def serving_engine(policy: Policy, context: int, max_batch_size: int, precision: str) -> Engine:
    tokenizer = policy.tokenizer
    return Engine(policy.model.to(resolve_device("rollout.device", "auto")), max_batch_size=max_batch_size,
                  max_context=context, eos_token_ids=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  tokenizer=tokenizer, numerics=Numerics(precision))


async def _serve_until_stopped(endpoint: Endpoint, request: ServeRequest, ready: Callable[[str, str], Any]) -> None:
    from flashreinforce.endpoint.server import EndpointServer  # the endpoint extra, checked above

    server = EndpointServer(endpoint, api_key=request.api_key or secrets.token_urlsafe(24), host=request.host,
                            port=request.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await server.start()
    try:
        ready(server.base_url(), server.api_key)
        await stop.wait()
    finally:
        await server.stop()
