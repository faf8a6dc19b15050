"""The trainer's attention on a CPU in bf16 or fp16: transformers' SDPA, computed in fp32.

torch's CPU flash attention is slow to differentiate in half precision over short rows: at 77 positions and heads
of 64 its forward and backward in bf16 take twice as long as in fp32 (2-3x at heads of 32), enough to make the
attention the largest part of a bf16 training step on a small model. Upcasting the queries, keys and values,
attending in fp32 and casting the output back is faster there and no less exact: every other product of the
step stays in the compute dtype. Over long rows the bf16 kernel is the faster one (0.7-0.9x at 256-2,048
positions and heads of 64-128, measured on an AVX-512 BF16 CPU), so a call upcasts only while its key positions
times its head width is at most UPCAST_LIMIT. On any other device, or in fp32, the function is transformers' own
SDPA attention untouched.

`FP32_SDPA` is registered with transformers' attention and mask registries under its own name (registering
adds a name and changes no other model of the process); the trainer switches its model to it
(`use_fp32_attention`). An engine given a copy of that model switches the copy back to "sdpa"
(families.engine_attention): the engine has attention of its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

FP32_SDPA = "sdpa_fp32_on_cpu"
"""The attention implementation name: transformers' "sdpa", upcast to fp32 for half-precision inputs on a CPU
over keys short enough (UPCAST_LIMIT)."""
HALF = (torch.bfloat16, torch.float16)
UPCAST_LIMIT = 12_288
"""Key positions x head width up to which fp32 is the faster (the crossings measured on an AVX-512 BF16 CPU by
`benchmarks/trainer_attention.py --kernels`: ~400 positions at a head width of 32, ~200 at 64, ~128 at 128)."""


def fp32_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' sdpa_attention_forward, in fp32 where the inputs are half precision on a CPU and the keys
    short enough (UPCAST_LIMIT)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.device.type != "cpu" or query.dtype not in HALF or key.shape[-2] * query.shape[-1] > UPCAST_LIMIT:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    output, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                             **kwargs)
    return output.to(query.dtype), weights


def register() -> None:
    """Add FP32_SDPA to transformers' registries (idempotent): its masks are SDPA's."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if FP32_SDPA not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(FP32_SDPA, fp32_sdpa_attention)
    if FP32_SDPA not in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(FP32_SDPA, sdpa_mask)


def use_fp32_attention(model: nn.Module, device: torch.device, compute_dtype: torch.dtype) -> bool:
    """Switch `model` (a transformers model running SDPA) to FP32_SDPA where it will compute in half precision
    on a CPU; returns whether it switched. Other attention implementations, devices and dtypes, models that are
    not transformers' own (a wrapper reading images) and classes that cannot switch attention at run time are
    left as they are."""
    from transformers import PreTrainedModel

    config = getattr(model, "config", None)
    if (device.type != "cpu" or compute_dtype not in HALF or not isinstance(model, PreTrainedModel)
            or getattr(config, "_attn_implementation", None) != "sdpa"
            or not model._can_set_attn_implementation()):  # asked anyway, such a class would only log a warning
        return False
    register()
    model.set_attn_implementation(FP32_SDPA)
    return config._attn_implementation == FP32_SDPA
