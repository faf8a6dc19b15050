"""Master weights: the optimizer steps fp32 copies, the model computes with their rounded or quantized form.

A bf16 weight carries 8 significant bits, so an AdamW update of about lr (1e-5, 1e-6) is below half the
spacing of bf16 numbers near any weight larger than ~1e-3 and rounds away: stepped in bf16, most
weights never move (tests/unit/trainer/test_master_weights.py shows it). The standard fix (Megatron,
DeepSpeed, verl) is kept here: the optimizer steps fp32 copies of the parameters (so its state is fp32 too),
and after each step the copies are written into the model in the trainer's format (models/numerics.py:
rounded to bf16, or fp8-quantized, in the compute dtype). The gradient of the formatted weight is applied to
its master unchanged (the straight-through estimator of quantization-aware training). The model computes
with the very weights the rollout engine loads (train-inference consistency).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from flashreinforce.models.numerics import Numerics, fp8_parameter_names, format_tensor

LOW_PRECISION = (torch.bfloat16, torch.float16)
"""Parameter dtypes that always get an fp32 master, whatever the numerics say."""


class MasterWeights:
    """The tensors an optimizer steps for `model`: an fp32 master for each parameter when the numerics format
    the weights (bf16, fp8) or the parameter is bf16/fp16, else the parameter itself (an fp32 model gets no
    copy and trains exactly as without this class).

    Building it casts the model to the numerics' compute dtype and writes the formatted masters into it. Use:
    build the optimizer on `params`; after backward call `grads_to_masters()`, clip and step, then
    `copy_to_model()`. Microbatch gradients still accumulate in the model's dtype (autograd's `.grad`).
    """

    def __init__(self, model: torch.nn.Module, numerics: Numerics | None = None) -> None:
        self.numerics = numerics or Numerics()
        fp8 = fp8_parameter_names(model) if self.numerics.precision == "fp8" else frozenset()
        self._names: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        self._pairs: list[tuple[str, torch.nn.Parameter, torch.nn.Parameter, bool]] = []  # (name, param, master, fp8)
        for name, param in model.named_parameters():  # tied weights come once, as in model.parameters()
            if not param.requires_grad:
                continue
            if self.numerics.formats_weights or param.dtype in LOW_PRECISION:
                master = torch.nn.Parameter(param.detach().float().clone())
                self._pairs.append((name, param, master, name in fp8))
                param = master
            self._names.append(name)
            self.params.append(param)
        if self.numerics.formats_weights:  # .to() keeps the Parameter objects, so the pairs stay valid
            model.to(self.numerics.compute_dtype)
        self.copy_to_model()

    def grads_to_masters(self) -> None:
        """Each master's grad := its parameter's grad in fp32; the low-precision grad is released."""
        move_grads_to_masters((param, master) for _, param, master, _ in self._pairs)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """The masters, formatted (rounded to nearest even, or fp8-quantized), into the model's parameters."""
        for _, param, master, fp8 in self._pairs:
            param.copy_(format_tensor(master, self.numerics, fp8=fp8) if self.numerics.formats_weights else master)

    @torch.no_grad()
    def copy_unformatted_to_model(self) -> None:
        """The masters as they are, not formatted, into the model's parameters (in their dtype). A warm start
        trained in bf16 or fp8 casts its model back to fp32 and calls this: it hands on full-precision weights,
        which each side of RL then formats for itself, as it does a pretrained model's."""
        for _, param, master, _ in self._pairs:
            param.copy_(master)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{parameter name: fp32 master}, empty for an fp32 model. The optimizer's state_dict holds no
        parameters, and the saved model holds only the rounded weights, so a resume needs these."""
        return {name: master.detach() for name, _, master, _ in self._pairs}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue from saved masters. A name this model steps in fp32 (a bf16 run resumed with
        precision.trainer=fp32) takes the saved value directly: it is more precise than the rounded weight."""
        stepped = dict(zip(self._names, self.params))
        for name, tensor in state.items():
            if name not in stepped or stepped[name].shape != tensor.shape:
                raise ValueError(f"the checkpoint's master weight {name!r} {tuple(tensor.shape)} is not a trainable "
                                 "parameter of this model; resume with the model the checkpoint was written for")
            stepped[name].copy_(tensor)
        self.copy_to_model()


def move_grads_to_masters(pairs: Iterable[tuple[torch.nn.Parameter, torch.nn.Parameter]]) -> None:
    """For each (parameter, master): the master's grad := the parameter's in fp32; the parameter's is released."""
    for param, master in pairs:
        master.grad = None if param.grad is None else param.grad.float()
        param.grad = None
