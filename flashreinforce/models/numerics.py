"""Numerics of one side (trainer or rollout engine): the format of its weights and the dtype it computes in.

    precision  weights                                        compute, separate   compute, unified
    fp32       fp32                                           fp32                fp32
    bf16       every floating tensor rounded to bf16          bf16 kernels        fp32 kernels
    fp8        linear weights e4m3 x scale (fake-quantized),  bf16 kernels        fp32 kernels
               every other tensor rounded to bf16

Separate: each side computes in its own dtype. The engine decodes one position at a time against a KV cache
while the trainer runs whole sequences, so their kernels accumulate in different orders and shapes; in bf16
every intermediate is rounded to 8 bits and those differences grow into log-prob gaps of up to 0.55 nats on
SmolLM2 (the measurement in the numerics issue). Unified: both sides hold the SAME quantized weights (the
trainer rounds its fp32 masters, the engine loads the result unchanged) and run every operator in fp32, where
the path differences stay at float rounding; the precision then decides what the policy is (its weights),
not how far the two sides drift apart. On CPU there are no fp8 kernels, so fp8 is simulated: e4m3 values
times an fp32 scale, dequantized into the compute dtype (what a real fp8 GEMM computes up to its own rounding).

Pure functions over tensors and state dicts; the trainer (master weights) and the engine (load_weights) call
them. Master weights and optimizer state are always fp32 (trainer/precision.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

PRECISIONS = ("fp32", "bf16", "fp8")
MODES = ("separate", "unified")
FP8_SCALINGS = ("tensor", "channel", "block")
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


@dataclass(frozen=True)
class Numerics:
    """How one side stores and computes with its weights."""

    precision: str = "fp32"
    """fp32 | bf16 | fp8: the format of the weights (see the module table)."""
    unified: bool = False
    """Compute in fp32 whatever the weight format (the unified mode)."""
    fp8_scaling: str = "channel"
    """fp8 scale granularity: one per tensor, per output channel (row), or per block x block tile."""
    fp8_block: int = 128

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not one of {PRECISIONS}")
        if self.fp8_scaling not in FP8_SCALINGS:
            raise ValueError(f"fp8_scaling {self.fp8_scaling!r} is not one of {FP8_SCALINGS}")
        if self.fp8_block < 1:
            raise ValueError(f"fp8_block={self.fp8_block}: must be >= 1")

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.precision == "fp32" or self.unified:
            return torch.float32
        return torch.bfloat16

    @property
    def formats_weights(self) -> bool:
        """Whether the weights differ from plain fp32 copies (so the trainer keeps fp32 masters apart)."""
        return self.precision != "fp32"


def fake_quant_e4m3(weight: torch.Tensor, scaling: str = "channel", block: int = 128) -> torch.Tensor:
    """weight rounded to e4m3 codes times a power-of-two scale per group, returned in weight's dtype.

    A group is the tensor, each output row, or each block x block tile of the last two dims; leading dims
    (the expert axis of a (E, out, in) tensor) split groups too. Each group's scale is the smallest power of
    two that fits its largest |value| within e4m3's largest finite value, 448 (as MXFP8's E8M0 scales and
    torchao's power-of-two option). Power-of-two scales cost at most one bit of range, but dividing and
    multiplying by them is exact, so quantizing a quantized tensor returns it bit for bit: the engine can
    quantize whatever weights it is sent, and in unified mode the trainer's quantized weights pass unchanged.
    An all-zero group stays zero.
    """
    x = weight.detach().float()
    amax = _group_amax(x, scaling, block)  # broadcastable to x
    mantissa, exponent = torch.frexp(amax / E4M3_MAX)  # amax / 448 = m 2^e with m in [0.5, 1)
    # The smallest power of two >= amax / 448; an exact power needs no more (else the code 448 rounded to
    # would halve on the next quantization and shift small codes out of range).
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), exponent), torch.ones_like(amax))
    codes = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (codes.float() * scale).to(weight.dtype)


def _group_amax(x: torch.Tensor, scaling: str, block: int) -> torch.Tensor:
    if x.ndim < 2:
        return x.abs().amax()
    if scaling == "tensor":
        return x.abs().amax(dim=(-2, -1), keepdim=True)  # (..., 1, 1): one scale per matrix (per expert)
    if scaling == "channel":
        return x.abs().amax(dim=-1, keepdim=True)  # (..., out, 1)
    if scaling != "block":
        raise ValueError(f"fp8_scaling {scaling!r} is not one of {FP8_SCALINGS}")
    rows, cols = x.shape[-2:]
    padded = torch.nn.functional.pad(x.abs(), (0, -cols % block, 0, -rows % block))  # zeros never win a max
    R, C = padded.shape[-2:]
    tiles = padded.reshape(*x.shape[:-2], R // block, block, C // block, block).amax(dim=(-3, -1))  # (..., R/b, C/b)
    full = tiles.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)  # (..., R, C)
    return full[..., :rows, :cols]


def fp8_parameter_names(model: torch.nn.Module) -> frozenset[str]:
    """Parameters an fp8 model quantizes: the weights of the linear layers inside the decoder and the stacked
    (experts, out, in) weights of MoE experts. Embeddings, the output head, norms, biases and gates (MoE
    routers, shared-expert gates) stay in bf16, as fp8 training recipes keep them: they are small, and routing
    and the output distribution are the most sensitive to rounding."""
    names = []
    for module_name, module in model.named_modules():
        last = module_name.rsplit(".", 1)[-1]
        if last == "lm_head" or last == "gate" or last.endswith("_gate"):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if (isinstance(module, torch.nn.Linear) and param_name == "weight") or param.ndim == 3:
                names.append(f"{module_name}.{param_name}" if module_name else param_name)
    return frozenset(names)


def format_tensor(tensor: torch.Tensor, numerics: Numerics, *, fp8: bool) -> torch.Tensor:
    """One tensor in the side's format and compute dtype; `fp8`: it is one of fp8_parameter_names."""
    if not tensor.is_floating_point():
        return tensor
    if numerics.precision == "fp8" and fp8:
        return fake_quant_e4m3(tensor.float(), numerics.fp8_scaling, numerics.fp8_block).to(numerics.compute_dtype)
    if numerics.precision in ("bf16", "fp8"):
        return tensor.to(torch.bfloat16).to(numerics.compute_dtype)
    return tensor.to(numerics.compute_dtype)


def format_state(state: Mapping[str, torch.Tensor], numerics: Numerics,
                 fp8_names: Iterable[str]) -> dict[str, torch.Tensor]:
    """A state dict in the side's format (see format_tensor)."""
    fp8_names = frozenset(fp8_names)
    return {name: format_tensor(tensor, numerics, fp8=name in fp8_names) for name, tensor in state.items()}
