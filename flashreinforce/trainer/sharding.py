"""FSDP2 sharding of the data-parallel trainer (trainer.sharding=fsdp): each rank holds 1/W of the weights,
gradients and AdamW state, instead of a full replica.

`torch.distributed.fsdp.fully_shard` is applied to every transformer block (the classes a Hugging Face model
names in `_no_split_modules`) and then to the root, so a forward gathers one block's weights at a time and a
backward reduce-scatters each block's gradients as soon as they are complete. The rest of the data-parallel
contract (trainer/distributed.py) is unchanged: every rank normalizes the whole batch and each microbatch's
loss is already divided by the global B and T, so the reduction must SUM the ranks' gradients; FSDP divides
by the world size unless told otherwise (`set_gradient_divide_factor(1)`).

Collectives: every forward and backward of a sharded model is one, so every rank must run the same number of
microbatches (`Trainer.step` pads a rank that has fewer with zero-loss passes), and reading the full weights,
saving the model or the optimizer state is a collective too: every rank calls it, rank 0 gets the full
tensors (on the CPU), the others an empty dict.

bf16 (precision.trainer=bf16): the sharded parameters stay fp32 and are the optimizer's masters; FSDP casts
each gathered block to bf16 for compute (`MixedPrecisionPolicy(param_dtype=bf16)`, round to nearest even,
as the unsharded trainer's master copy does) and reduces gradients in fp32.

fp8, and the unified mode (models/numerics.py): FSDP's cast cannot express these formats (fp8 scales span a
row, a tile or a whole tensor; unified rounds the weights but computes in fp32), so ShardedMasters keeps them
as the unsharded trainer's MasterWeights does: the model's shards hold the formatted weights in the compute
dtype, and an fp32 copy of the model, sharded the same way and never run, holds the masters AdamW steps.

LoRA (trainer/lora.py): the base model, with the adapter layers peft put in it, is the root; its frozen
weights are formatted first (bf16 or fp32) and the adapters are fp32, and FSDP casts nothing: each computes in
its own dtype, as unsharded. Only the adapters have gradients (all fp32, as a reduce-scatter needs).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from flashreinforce.models.numerics import Numerics, format_tensor, fp8_parameter_names
from flashreinforce.trainer.precision import move_grads_to_masters

SHARDINGS = ("replicate", "fsdp")

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""Full tensors on rank 0's CPU, nothing on the others (no rank holds two full copies on its device)."""
_SCATTER = StateDictOptions(full_state_dict=True)
"""Every rank passes the same full state; each keeps its shard."""
_SCATTER_SOME = StateDictOptions(full_state_dict=True, strict=False)
"""As _SCATTER for some of the model's tensors (a LoRA checkpoint's adapters and adapted base weights)."""


def shard_model(model: torch.nn.Module, compute_dtype: torch.dtype | None) -> int:
    """Shard `model` in place over the default process group; returns the number of blocks sharded apart
    from the root. The model must be on its device. `compute_dtype`: what FSDP casts the gathered parameters
    to (the model must then be fp32); None computes in each parameter's own dtype (a LoRA model's formatted
    frozen base and fp32 adapters, whose gradients, the adapters' only, are fp32)."""
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    cast = compute_dtype not in (None, torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype if cast else None, reduce_dtype=torch.float32)
    blocks = [module for module in model.modules() if type(module).__name__ in block_names]
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # the losses are globally normalized: sum, do not average
            # a plain SUM reduce-scatter: with a custom factor FSDP would ask for PREMUL_SUM, which gloo lacks
            module.set_force_sum_reduction_for_comms(True)
    return len(blocks)


def reshard(model: torch.nn.Module) -> None:
    """Free the full parameters a forward without a backward leaves gathered: FSDP's root module keeps its own
    (the embeddings, the final norm, the LM head) gathered after a forward, for the backward it expects, and a
    state-dict load into them would then meet plain tensors where it expects shards."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def casts_for_compute(numerics: Numerics) -> bool:
    """Whether FSDP's own cast of the gathered fp32 shards gives this format: fp32, or bf16 computing in bf16
    (else ShardedMasters formats the shards)."""
    return numerics.precision == "fp32" or (numerics.precision == "bf16" and not numerics.unified)


class ShardedMasters:
    """MasterWeights (trainer/precision.py) of a sharded model whose format FSDP cannot cast to (fp8, unified).

    Building it formats `model`'s weights into its compute dtype and shards it, and shards an fp32 copy of it
    (`shadow`) the same way: each master shard sits beside the shard of the weight it formats, so formatting
    needs no communication except where a scale spans rows that other ranks hold (fp8 tensor or block scales
    of a matrix: that master is gathered, formatted whole, and this rank keeps its rows). The shadow only
    names the masters (a sharded checkpoint's optimizer state and masters are keyed by its parameter names); it
    never runs. Separate-mode fp8 computes in bf16, so its gradient shards are bf16 too (FSDP reduces in fp32,
    then casts to the parameter's dtype) where an unsharded bf16 trainer sums its ranks' bf16 gradients in fp32.
    """

    def __init__(self, model: torch.nn.Module, numerics: Numerics) -> None:
        self.numerics = numerics
        self.shadow = copy.deepcopy(model).float()  # the full-precision values, before formatting rounds them
        self._fp8 = fp8_parameter_names(model) if numerics.precision == "fp8" else frozenset()
        model.to(numerics.compute_dtype)
        shard_model(model, compute_dtype=None)
        shard_model(self.shadow, compute_dtype=None)
        masters = dict(self.shadow.named_parameters())
        self._pairs = [(name, param, masters[name]) for name, param in model.named_parameters()]
        self.params = [master for _, _, master in self._pairs]
        self.copy_to_model()

    def grads_to_masters(self) -> None:
        """Each master shard's grad := its parameter shard's grad in fp32 (already summed over the ranks)."""
        move_grads_to_masters((param, master) for _, param, master in self._pairs)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Collective where a scale spans ranks: the masters, formatted, into the model's shards."""
        for name, param, master in self._pairs:
            param.to_local().copy_(self._formatted_shard(master, fp8=name in self._fp8))

    def _formatted_shard(self, master: DTensor, *, fp8: bool) -> torch.Tensor:
        # FSDP shards dim 0: a stacked expert tensor (E, out, in) keeps whole experts and a matrix whole rows, so
        # per-row scales, and an expert's own tensor or block scales, are local; a matrix's tensor or block
        # scales are not.
        if fp8 and self.numerics.fp8_scaling != "channel" and master.ndim == 2:
            whole = format_tensor(master.full_tensor(), self.numerics, fp8=True)
            return distribute_tensor(whole, master.device_mesh, master.placements, src_data_rank=None).to_local()
        return format_tensor(master.to_local(), self.numerics, fp8=fp8)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the model's full state dict on rank 0 (CPU), {} on the other ranks."""
    return get_model_state_dict(model, options=_GATHER)


def load_full_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor], partial: bool = False) -> None:
    """Collective: every rank gives the same full state dict and keeps its shard of it; `partial`: `state`
    holds some of the model's tensors, the others are kept."""
    set_model_state_dict(model, dict(state), options=_SCATTER_SOME if partial else _SCATTER)


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: the optimizer's state, keyed by parameter name, full on rank 0, {} on the others."""
    return get_optimizer_state_dict(model, optimizer, options=_GATHER)


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              state: Mapping[str, Any]) -> None:
    """Collective: every rank gives the same full optimizer state (full_optimizer_state's) and keeps its shard."""
    set_optimizer_state_dict(model, optimizer, dict(state), options=_SCATTER)


def total_norm(norm: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_'s result as a plain tensor: over sharded gradients it is a DTensor (already reduced
    over the ranks)."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm

