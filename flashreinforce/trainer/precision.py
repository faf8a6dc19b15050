"""Mixed precision: a bf16 model computes, fp32 master weights take the optimizer steps.

A bf16 weight carries 8 significant bits, so an AdamW update of about lr (1e-5, 1e-6) is below half the
spacing of bf16 numbers near any weight larger than ~1e-3 and rounds away: stepped in bf16, most
weights never move (tests/unit/trainer/test_master_weights.py shows it). The standard fix (Megatron,
DeepSpeed, verl) is kept here: the optimizer steps fp32 copies of the low-precision parameters (so its
state is fp32 too), and after each step the copies are rounded into the model. The model stays in its own
dtype, so the trainer computes with the very weights the rollout engine loads (train-inference consistency).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
"""Parameter dtypes that get an fp32 master; fp32 and fp64 parameters are stepped as they are."""


class MasterWeights:
    """The tensors an optimizer steps for `model`: an fp32 master for each bf16/fp16 parameter, else the
    parameter itself (an fp32 model gets no copy and trains exactly as without this class).

    Use: build the optimizer on `params`; after backward call `grads_to_masters()`, clip and step, then
    `copy_to_model()`. Microbatch gradients still accumulate in the model's dtype (autograd's `.grad`).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._names: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        self._pairs: list[tuple[str, torch.nn.Parameter, torch.nn.Parameter]] = []  # (name, parameter, master)
        for name, param in model.named_parameters():  # tied weights come once, as in model.parameters()
            if not param.requires_grad:
                continue
            if param.dtype in LOW_PRECISION:
                master = torch.nn.Parameter(param.detach().float().clone())
                self._pairs.append((name, param, master))
                param = master
            self._names.append(name)
            self.params.append(param)

    def grads_to_masters(self) -> None:
        """Each master's grad := its parameter's grad in fp32; the low-precision grad is released."""
        for _, param, master in self._pairs:
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the masters into the model's parameters (round to nearest even, as `copy_` casts)."""
        for _, param, master in self._pairs:
            param.copy_(master)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{parameter name: fp32 master}, empty for an fp32 model. The optimizer's state_dict holds no
        parameters, and the saved model holds only the rounded weights, so a resume needs these."""
        return {name: master.detach() for name, _, master in self._pairs}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue from saved masters. A name this model steps in fp32 (a bf16 run resumed with
        model.dtype=float32) takes the saved value directly: it is more precise than the rounded weight."""
        stepped = dict(zip(self._names, self.params))
        for name, tensor in state.items():
            if name not in stepped or stepped[name].shape != tensor.shape:
                raise ValueError(f"the checkpoint's master weight {name!r} {tuple(tensor.shape)} is not a trainable "
                                 "parameter of this model; resume with the model the checkpoint was written for")
            stepped[name].copy_(tensor)
        self.copy_to_model()
