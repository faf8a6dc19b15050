"""The engine's decoding step for Llama-shaped models with the small operations and the attention fused.

A decoding step feeds one token a row. At a few dozen rows its matrix products are small, and a model's own forward
spends a large share of a bf16 step on a few hundred tiny framework kernels (norms, rotary embeddings, activations,
residual adds), each costing its dispatch rather than its arithmetic, and its attention reads every row up to the
longest row's length through one mask. This path runs the same decoder layers with the model's own weights, does
each layer's small operations and its attention in three C functions (decode_kernels.c: residual add with RMSNorm;
rotary embeddings, KV cache write and attention over each row's own positions; SiLU gate), and its matrix products on
weights packed for small batches (`_Linears`: q, k, v as one product, gate and up as another). The small operations
round where the model's code rounds, and the norm adds its squares in the order this torch's sum kernel does
(`sum_lanes`); the attention and the packed fp32 products add in other orders than the framework's kernels, so the
logits differ from the model forward's within fp32 rounding, or a bf16 rounding in bf16
(tests/unit/rollout/test_fused_decode.py).

The C file is compiled at first use with the system's C compiler (`cc`, or $CC) into
$FLASHREINFORCE_CACHE/kernels (else ~/.cache/flashreinforce/kernels), keyed by the source, flags and CPU. Without
a compiler, or for a model this path does not serve (`unsupported`), the engine runs the model's own forward.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from flashreinforce.models.families import head_dim
from flashreinforce.rollout.kv_cache import SlotCache

_SOURCE = Path(__file__).with_name("decode_kernels.c")
# Vectorized for this machine's CPU (the library is keyed by it below); no fast-math and no fused multiply-adds:
# the kernels round where the framework does.
_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# Decoder layers whose forward is residual + attention(norm(x)), then residual + mlp(norm(x)), with rotate-half
# rotary embeddings and a SiLU-gated MLP: what this path computes.
_LAYER_CLASSES = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})


PREFILL_CHUNK = 1024
"""Prompt tokens a fused prefill forward takes at most: large enough for efficient products, small enough that a
long prompt's activations stay a few MB a layer."""


class KernelsUnavailable(RuntimeError):
    """The C kernels could not be built or loaded here (no compiler, a failed build)."""


def _cache_dir() -> Path:
    root = os.environ.get("FLASHREINFORCE_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "flashreinforce") / "kernels"


def _build(source: Path, target: Path, extra_flags: tuple[str, ...] = ()) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise KernelsUnavailable("no C compiler found (install gcc, or set $CC): the fused decoding step needs one "
                                 "once, to build its kernels")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        for threading in (["-fopenmp"], []):  # a compiler without OpenMP builds the attention single-threaded
            command = [compiler, *_FLAGS, *extra_flags, *threading, "-o", str(built), str(source), "-lm"]
            try:
                result = subprocess.run(command, capture_output=True, text=True, check=False)
            except OSError as error:
                raise KernelsUnavailable(f"the C compiler {compiler!r} did not run ({error}): install gcc, or set "
                                         "$CC to a C compiler") from error
            if result.returncode == 0:
                break
        if result.returncode != 0:
            raise KernelsUnavailable(f"the C compiler failed on {source.name} ({' '.join(command)}): "
                                     f"{result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent process sees no half-written library


def _cpu_identity() -> bytes:
    """What -march=native builds for: a library built on one CPU may not run on another (a shared home)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode() + platform.machine().encode()
    wanted = (next((line for line in lines if line.startswith(key)), "") for key in ("model name", "flags"))
    return "".join(wanted).encode()


@cache
def kernels() -> ctypes.CDLL:
    """The compiled kernels, built on first use; KernelsUnavailable says why not."""
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + _cpu_identity()).hexdigest()[:16]
    target = _cache_dir() / f"decode_kernels-{digest}.so"
    try:
        if not target.exists():
            _build(_SOURCE, target)
        library = ctypes.CDLL(str(target))
    except OSError as error:  # an unwritable cache directory, a library the loader refuses
        raise KernelsUnavailable(f"the kernels could not be built or loaded at {target} ({error}): set "
                                 "$FLASHREINFORCE_CACHE to a writable directory") from error
    return declared(library)


def declared(library: ctypes.CDLL) -> ctypes.CDLL:
    """The kernels' signatures declared on a loaded build of decode_kernels.c."""
    i64, ptr, f32, code = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    library.add_rms_norm.argtypes = [code, ptr, ptr, ptr, ptr, i64, i64, f32, i64, ptr]
    library.ordered_sum.argtypes, library.ordered_sum.restype = [ptr, i64, i64], f32
    library.silu_mul.argtypes = [code, ptr, ptr, i64, i64]
    library.decode_attention.argtypes = [code, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32,
                                         ctypes.c_int]
    library.decode_attention.restype = ctypes.c_int
    for function in (library.add_rms_norm, library.silu_mul):
        function.restype = None
    return library


@cache
def sum_lanes(size: int) -> int:
    """The vector width (in floats) with which this torch adds `size` floats on this CPU, found by matching its
    sum bit for bit on sums whose rounding depends on the order; 0 when no width the kernels know matches."""
    library = kernels()
    generator = torch.Generator().manual_seed(0)
    scales = torch.logspace(-3, 3, size)  # magnitudes spread wide, so that each order rounds its own way
    probes = [torch.randn(size, generator=generator) * scales[torch.randperm(size, generator=generator)]
              for _ in range(8)]
    for lanes in (16, 8, 4, 1):
        if all(library.ordered_sum(p.data_ptr(), size, lanes) == p.sum().item() for p in probes):
            return lanes
    return 0


def unsupported(model: nn.Module) -> str | None:
    """Why the fused step cannot run `model` exactly (None: it can)."""
    inner = getattr(model, "model", None)
    config = getattr(model, "config", None)
    if inner is None or config is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return f"{type(model).__name__} is not a causal LM with decoder layers and rotary embeddings"
    names = {type(layer).__name__ for layer in inner.layers}
    if not names <= _LAYER_CLASSES:
        return f"decoder layers {sorted(names - _LAYER_CLASSES)} are not among {sorted(_LAYER_CLASSES)}"
    if config.hidden_act != "silu":
        return f"hidden_act={config.hidden_act!r}: the fused activation is SiLU"
    if config._attn_implementation != "sdpa":
        return f"attention {config._attn_implementation!r}: the fused step calls SDPA as the model's sdpa does"
    if getattr(config, "pretraining_tp", 1) > 1:
        return "pretraining_tp > 1 splits the projections"
    if model.dtype not in _DTYPE_CODES:
        return f"dtype {model.dtype}: the kernels compute float32 and bfloat16"
    if next(model.parameters()).device.type != "cpu":
        return "the kernels run on the CPU; on a GPU the model's own forward is used"
    # The kernels read raw memory in the model's dtype: a parameter kept in another would be misread.
    if any(p.dtype != model.dtype or not p.is_contiguous() for p in model.parameters()):
        return f"parameters not all contiguous {model.dtype}"
    layer = inner.layers[0]
    if type(layer.self_attn.q_proj) is not nn.Linear or type(layer.mlp.gate_proj) is not nn.Linear:
        return f"projections are {type(layer.self_attn.q_proj).__name__}, not plain Linear layers"
    with torch.no_grad():
        cos, _ = inner.rotary_emb(torch.zeros(1, 1, dtype=model.dtype), torch.zeros(1, 1, dtype=torch.long))
    if cos.shape[-1] != head_dim(config):
        return f"rotary embeddings over {cos.shape[-1]} of the head's {head_dim(config)} dimensions"
    return None


def _linear_packer(dtype: torch.dtype) -> Callable[[torch.Tensor, int], torch.Tensor] | None:
    """oneDNN's weight reorder for a matrix product at a given batch size, where this torch and CPU have it for
    `dtype` (else None: plain products)."""
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if not torch.backends.mkldnn.is_available() or reorder is None:
        return None
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return reorder


def row_bucket(rows: int, slots: int) -> int:
    """The row count a packed product runs at for `rows` rows: the next power of two up to the engine's `slots`,
    above them the next multiple of them. oneDNN compiles a kernel per row count and keeps a bounded cache of them
    (the command line bounds it at 64); continuous batching meets every count from 1 to the slots, five products
    each, and prefills more, so unbucketed products missed the cache and recompiled all the time. With buckets a
    128-slot engine needs 8 counts a product, at most twice the rows of arithmetic in a product whose cost at
    these sizes is reading its weights."""
    if rows >= slots:
        return -(-rows // slots) * slots
    return min(1 << (rows - 1).bit_length(), slots)


class _Linears:
    """The decoding step's matrix products over weights packed once for it: q, k, v stacked into one product and
    gate, up into another, each weight reordered by oneDNN for small batches (1.7-3.7x faster than an unpacked
    product at 8 rows on a 2-core AVX-512 CPU; in bf16 the same bits), at bucketed row counts (`row_bucket`).
    Packed copies go stale when a push or a cast changes the model's parameters: `current` notices, and the
    decoder repacks."""

    def __init__(self, model: nn.Module, rows: int):
        self._model, self._rows, self._reorder = model, rows, _linear_packer(model.dtype)
        self.pack()

    def _signature(self) -> list[tuple[int, int]]:
        """Each packed parameter's storage and version counter (torch bumps it at every in-place write), read
        through the modules so that a parameter replaced whole is seen too."""
        parameters = [p for layer in self._model.model.layers for p in _projection_parameters(layer)]
        return [(p.data_ptr(), p._version) for p in (*parameters, self._model.lm_head.weight)]

    def current(self) -> bool:
        return self._signature() == self._packed_at

    def pack(self) -> None:
        with torch.no_grad():
            self.layers = [
                {"qkv": self._packed(layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                 "o": self._packed(layer.self_attn, ("o_proj",)),
                 "gate_up": self._packed(layer.mlp, ("gate_proj", "up_proj")),
                 "down": self._packed(layer.mlp, ("down_proj",))}
                for layer in self._model.model.layers]
            self.head = self._packed(self._model, ("lm_head",))
        self._packed_at = self._signature()

    def _packed(self, module: nn.Module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        linears = [getattr(module, name) for name in names]
        weight = torch.cat([linear.weight for linear in linears])
        bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
        return (weight if self._reorder is None else self._reorder(weight, self._rows)), bias

    def __call__(self, x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        weight, bias = packed
        if self._reorder is None:
            return F.linear(x, weight, bias)
        rows = x.shape[0]
        bucket = row_bucket(rows, self._rows)
        if bucket != rows:  # zero rows: a row's product reads its own row only, and zeros are never denormal
            x = torch.cat([x, x.new_zeros(bucket - rows, x.shape[1])])
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:rows]


def _projection_parameters(layer: nn.Module) -> list[torch.Tensor]:
    attention, mlp = layer.self_attn, layer.mlp
    linears = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj,
               mlp.down_proj]
    return [p for linear in linears for p in (linear.weight, linear.bias) if p is not None]


class FusedDecoder:
    """Next-token logits of one token a row, through `model`'s own weights and the engine's SlotCache."""

    def __init__(self, model: nn.Module, rows: int):
        """`rows`: the engine's slots, the batch size the packed weights are laid out for."""
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"the fused decoding step cannot run this model: {reason}")
        self._kernels = kernels()
        self._inner = model.model
        self._code = _DTYPE_CODES[model.dtype]
        config = model.config
        self._heads, self._kv_heads = config.num_attention_heads, config.num_key_value_heads
        self._head_dim = head_dim(config)
        self._scratch = torch.empty(2 * config.hidden_size, dtype=torch.float32)
        # With no width matching, norms may differ from the model's in the last bit now and then.
        self._lanes = sum_lanes(config.hidden_size) or 16
        self._linear = _Linears(model, rows)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        """A decoding step: input_ids and positions (n,), with the cache's step planned; logits (n, V). Each row
        attends to its own slot's positions up to its own, so rows of any lengths share one step without a mask."""
        slots, _ = cache.decode_rows()  # (the rotary position is the KV position: no M-RoPE here)
        return self._linear(self._layers(input_ids, positions, slots, cache), self._linear.head)

    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: SlotCache) -> None:
        """Store the keys and values of tokens input_ids (T,) at their slots and positions (T,), a request's tokens
        in order, without padding, PREFILL_CHUNK tokens a forward (a token reads the keys of its request's earlier
        ones, stored by an earlier chunk or by its own); no logits."""
        for start in range(0, len(input_ids), PREFILL_CHUNK):
            chunk = slice(start, start + PREFILL_CHUNK)
            self._layers(input_ids[chunk], positions[chunk], slots[chunk], cache)

    def _layers(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                cache: SlotCache) -> torch.Tensor:
        """The decoder layers over rows a token each, at `positions` of KV `slots`; the final norm's output."""
        if not self._linear.current():
            self._linear.pack()
        hidden = self._inner.embed_tokens(input_ids)  # (n, hidden)
        cos, sin = self._inner.rotary_emb(hidden, positions[:, None])  # (n, 1, head_dim) each
        cos, sin = cos.contiguous(), sin.contiguous()
        slots, positions = (t.to(torch.int64).contiguous() for t in (slots, positions))  # read by C
        # The C function writes there unchecked: a position or slot past the stores would overwrite memory.
        if int(positions.max()) >= cache.max_context or int(slots.max()) >= cache.num_slots:
            raise IndexError(f"fused forward past the KV stores ({cache.num_slots} slots x {cache.max_context})")
        step = (cos, sin, slots, positions, torch.get_num_threads())
        store_like = hidden.new_empty(1, self._kv_heads, 1, self._head_dim)  # how SlotCache allocates a layer
        residual = hidden
        layers = self._inner.layers
        normed = self._norm(layers[0].input_layernorm, hidden, None)
        for index, (layer, packed) in enumerate(zip(layers, self._linear.layers)):
            keys, values = cache.layer(index, store_like, store_like)
            update = self._attention(layer.self_attn, packed, normed, step, keys, values)
            normed = self._norm(layer.post_attention_layernorm, update, residual)
            update = self._linear(self._silu_mul(self._linear(normed, packed["gate_up"])), packed["down"])
            following = layers[index + 1].input_layernorm if index + 1 < len(layers) else self._inner.norm
            normed = self._norm(following, update, residual)
        return normed

    def _norm(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """norm(x), or with a residual: residual += x (in place), then norm(residual)."""
        out = torch.empty_like(x)
        rows, dim = x.numel() // x.shape[-1], x.shape[-1]
        self._kernels.add_rms_norm(self._code, x.data_ptr(), None if residual is None else residual.data_ptr(),
                                   norm.weight.data_ptr(),
                                   out.data_ptr(), rows, dim, norm.variance_epsilon, self._lanes,
                                   self._scratch.data_ptr())
        return out

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of each row's halves (n, 2 * width) -> (n, width)."""
        n, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(n, width)
        self._kernels.silu_mul(self._code, gate_up.data_ptr(), out.data_ptr(), n, width)
        return out

    def _attention(self, attention: nn.Module, packed: dict, x: torch.Tensor, step: tuple,
                   keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """step: the rotary angles, each row's KV slot and position, and the threads to split rows over."""
        cos, sin, slots, positions, threads = step
        n = x.shape[0]
        qkv = self._linear(x, packed["qkv"])  # (n, (heads + 2 * kv_heads) * head_dim)
        out = qkv.new_empty(n, self._heads * self._head_dim)
        failed = self._kernels.decode_attention(
            self._code, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(),
            slots.data_ptr(), positions.data_ptr(), out.data_ptr(), n, self._heads, self._kv_heads, self._head_dim,
            keys.shape[2], attention.scaling, threads)
        if failed:
            raise MemoryError("the fused attention could not allocate its scratch memory")
        return self._linear(out, packed["o"])
