"""LoRA adapters (peft) on the trainer's model: only the adapters train; pushes send the adapter alone.

The rollout engine holds a plain copy of the model under the base model's names. A push is an adapter push
(models/adapter_push.py, `push_state`): each adapted layer's A, B and scale, and, the first time an engine is pushed
to, every tensor of the base model with the adapted layers unmerged; the engine merges W + scale * B @ A itself
(rollout/adapters.py), so the base travels once. `merged_state()` gives the same merge here, for each adapted
linear layer under the base model's name and every other tensor as it is: what a save writes (and an engine that
loads only full weights is given). It is computed afresh into new tensors: peft's own merge writes the delta into W
in place, and `merge_and_unload` ends training on the adapter.

Numerics: the frozen base takes the trainer's format once, as a full fine-tune's weights do through
MasterWeights (bf16-rounded or fp8-quantized, in the compute dtype). The adapters stay fp32 (peft's
autocast_adapter_dtype) and, being the only trainable parameters, are stepped directly: they need no masters.
In fp32 the merged weights compute what the adapter model computes up to float rounding. With bf16 or fp8 the
engine formats the merged weight, format(W + scale * B @ A), while the trainer computes format(W) x plus the
unrounded adapter path: one rounding of the merged weight apart. In precision.mode=unified that gap is what
remains of the mismatch (measured on a tiny model: mean |log mu - log pi| 1e-3 with LoRA vs 2e-7 without), so
a warning says so (docs/lora.md).

What a save holds: `save(directory)` writes the merged model in Hugging Face format (from_pretrained loads it,
with no peft) and the adapter alone in peft format under `directory/adapter/`. The trainer state
(`state_dict`) holds the adapter and the frozen base weights of the adapted layers: a resume builds its model
from the saved merged weights, and W + D - D is not W in floating point, so the base cannot be recovered from
them exactly. With both restored, a resumed run steps exactly as an uninterrupted one.

MoE models: routed experts are stacked 3D parameters inside one module, not linear layers; they get no
adapter and stay frozen, as do the routers (a warning says so). Attention and the shared expert's linear
layers are adapted by the default target names.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashreinforce.models.adapter_push import AdapterLayer, merge_weight
from flashreinforce.models.numerics import Numerics, format_tensor, fp8_parameter_names

ALL_LINEAR = "all-linear"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INSTALL_HINT = "pip install 'flashreinforce[lora]'"
_ADAPTER = "default"  # peft's name for the one adapter
_NAMES_SHOWN = 20
_EXPERTS = "a stack of routed MoE experts, which LoRA here does not adapt (they stay frozen)"


@dataclass(frozen=True)
class LoraSettings:
    """What trainer.lora configures, plus the seed of the adapters' initialization."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = DEFAULT_TARGETS
    """Names matched against the end of each linear module's dotted name, or "all-linear"."""
    rslora: bool = False
    seed: int = 0
    """The adapters' random init draws from its own generator seeded with this, not from the run's stream."""
    push: str = "adapter"
    """What Trainer.push_state gives the engines: "adapter" (models/adapter_push.py) or "merged" (the full model)."""

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"trainer.lora.r={self.r}: the adapter rank must be >= 1")
        if not self.alpha > 0:
            raise ValueError(f"trainer.lora.alpha={self.alpha}: must be > 0 (the update is alpha / r * B @ A)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"trainer.lora.dropout={self.dropout}: must be in [0, 1)")
        if self.push not in ("adapter", "merged"):
            raise ValueError(f"trainer.lora.push={self.push!r}: must be adapter or merged")
        if isinstance(self.target_modules, str):
            if self.target_modules != ALL_LINEAR:
                raise ValueError(f"trainer.lora.target_modules={self.target_modules!r}: give a list of module "
                                 f"names (e.g. [q_proj, v_proj]) or {ALL_LINEAR!r}")
        elif not self.target_modules or not all(isinstance(n, str) and n for n in self.target_modules):
            raise ValueError(f"trainer.lora.target_modules={list(self.target_modules)!r}: name at least one "
                             f"module, each a non-empty string, or use {ALL_LINEAR!r}")

    def fingerprint(self) -> dict[str, Any]:
        """The settings a checkpoint's adapter depends on (dropout and seed do not change its tensors' use)."""
        return {"r": self.r, "alpha": float(self.alpha), "rslora": self.rslora}


def require_peft() -> Any:
    """The peft module, or a ValueError saying how to install it (a ValueError: the CLI prints it as one line)."""
    try:
        import peft
    except ImportError:
        raise ValueError(f"trainer.lora needs the peft package, which is not installed: {INSTALL_HINT}") from None
    return peft


def linear_layers(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """Every nn.Linear of the model by dotted name, except its output layer (lm_head: with tied embeddings
    it is the input embedding too, and an adapter there would untie what the engine's model ties)."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name: module for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not output}


def _matches(name: str, target: str) -> bool:
    """peft's rule for a target in a list: the whole dotted name, or its end after a dot."""
    return name == target or name.endswith(f".{target}")


def _is_gate(name: str) -> bool:
    """MoE routers and shared-expert gates (fp8_parameter_names keeps them out of fp8 for the same reason:
    routing is the most sensitive to small changes); "all-linear" leaves them out."""
    last = name.rsplit(".", 1)[-1]
    return last == "gate" or last.endswith("_gate")


def resolve_targets(model: torch.nn.Module, targets: Sequence[str] | str) -> list[str]:
    """The full dotted names of the linear layers that get an adapter, in the model's order.

    Every name must match at least one linear layer (else the error lists the model's linear layer names)
    and nothing but linear layers, so a typo or a name of something LoRA here cannot adapt fails at build.
    """
    linears = linear_layers(model)
    if targets == ALL_LINEAR:
        chosen = {name for name in linears if not _is_gate(name)}
    else:
        modules = dict(model.named_modules())
        chosen = set()
        for target in targets:
            hits = [name for name in modules if _matches(name, target)]
            others = [name for name in hits if name not in linears]
            if others or not hits:
                raise _target_error(model, target, others, linears)
            chosen.update(hits)
    if not chosen:
        raise ValueError(f"trainer.lora.target_modules={ALL_LINEAR!r}: this model has no linear layer to adapt "
                         f"besides its output layer; linear layers: {_leaf_names(linears) or 'none'}")
    return [name for name in linears if name in chosen]


def _leaf_names(linears: Mapping[str, torch.nn.Module]) -> str:
    leaves = list(dict.fromkeys(name.rsplit(".", 1)[-1] for name in linears))
    shown = ", ".join(leaves[:_NAMES_SHOWN])
    return shown + (f" (and {len(leaves) - _NAMES_SHOWN} more)" if len(leaves) > _NAMES_SHOWN else "")


def _target_error(model: torch.nn.Module, target: str, others: Sequence[str],
                  linears: Mapping[str, torch.nn.Module]) -> ValueError:
    """Why `target` cannot be adapted: it names something else (the output layer, a module of another kind,
    a parameter such as a routed-expert stack) or nothing; the message lists the names that would work."""
    if others:
        module = model.get_submodule(others[0])
        if isinstance(module, torch.nn.Linear):
            what = f"it names {others[0]}, the output layer, which is never adapted"
        else:
            what = f"it names {others[0]} ({type(module).__name__}), which is not a linear layer"
            if any(param.ndim == 3 for param in module.parameters(recurse=False)):
                what += f" but {_EXPERTS}"
    else:
        what = "it matches no linear layer of this model"
        params = [(name, param) for name, param in model.named_parameters() if _matches(name, target)]
        if params:
            name, param = params[0]
            what += f"; {name} {tuple(param.shape)} is a parameter, " + (_EXPERTS if param.ndim == 3 else
                                                                          "not a module")
    return ValueError(f"trainer.lora.target_modules: {target!r} cannot take an adapter: {what}. Linear layers "
                      f"of this model: {_leaf_names(linears)} (a name matches a module's full dotted name or its "
                      f"end, e.g. q_proj or self_attn.q_proj), or use {ALL_LINEAR!r}")


def _warn_unified(numerics: Numerics) -> None:
    if numerics.unified and numerics.formats_weights:
        warnings.warn(f"trainer.lora with precision.mode=unified ({numerics.precision}): the engine rounds each merged "
                      "weight W + scale * B @ A, the trainer computes the rounded base plus the fp32 adapters, so "
                      "their log-probs differ by about one rounding of the merged weights, not by float rounding "
                      "as without LoRA (docs/lora.md)", stacklevel=3)


def _warn_frozen_experts(model: torch.nn.Module) -> None:
    stacks = [name for name, param in model.named_parameters() if param.ndim == 3]
    if stacks:
        warnings.warn(f"trainer.lora: this MoE model's {len(stacks)} routed-expert stacks ({stacks[0]}, ...) and its "
                      "routers get no adapter and stay frozen; adapters go on linear layers only (attention, the "
                      "shared expert)", stacklevel=3)


@torch.no_grad()
def format_base(model: torch.nn.Module, numerics: Numerics) -> None:
    """The base weights in the trainer's format and compute dtype, as MasterWeights formats a full
    fine-tune's: each value formatted from its full-precision value first (bf16 and fp8 values are exact in
    fp32, so the in-place copy loses nothing), then the model cast to the compute dtype (exact too)."""
    if not numerics.formats_weights:
        return
    fp8 = fp8_parameter_names(model) if numerics.precision == "fp8" else frozenset()
    for name, param in model.named_parameters():
        param.copy_(format_tensor(param, numerics, fp8=name in fp8))
    model.to(numerics.compute_dtype)


def attach_lora(model: torch.nn.Module, settings: LoraSettings, numerics: Numerics | None = None) -> LoraAdapter:
    """Wrap `model` (in place: peft swaps its target layers) in LoRA adapters; the base is frozen.

    Checks the target names before peft sees them, formats the base (format_base), and initializes the
    adapters from `settings.seed` without touching the global random stream (B = 0: the merged weights
    start equal to the base's).
    """
    peft = require_peft()
    numerics = numerics or Numerics()
    targets = resolve_targets(model, settings.target_modules)
    _warn_frozen_experts(model)
    _warn_unified(numerics)
    names = list(model.state_dict())
    format_base(model, numerics)
    config = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=targets, use_rslora=settings.rslora, bias="none", task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.manual_seed(settings.seed)
        # transformers deprecates an attribute peft still reads; nothing for a user to act on.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        wrapped = peft.get_peft_model(model, config, autocast_adapter_dtype=True)
    return LoraAdapter(wrapped, names, targets, settings)


class LoraAdapter:
    """A peft-wrapped model and what the trainer needs of it: trainable parameters, merged weights, saving
    and the state a resume continues from. `model` is what the trainer runs forward and backward."""

    def __init__(self, model: torch.nn.Module, names: Sequence[str], targets: Sequence[str],
                 settings: LoraSettings) -> None:
        self.model = model
        self.settings = settings
        self.targets = tuple(targets)
        self._names = tuple(names)
        """The base model's state-dict names, in order: what merged_state returns."""
        base = model.get_base_model()
        self._layers = {name: base.get_submodule(name) for name in targets}

    @property
    def trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name, param) for name, param in self.model.named_parameters() if param.requires_grad]

    @property
    def base(self) -> torch.nn.Module:
        """The base model with the adapter layers in it (peft swaps them in place): a sharded trainer's FSDP root."""
        return self.model.get_base_model()

    @torch.no_grad()
    def merged_state(self, live: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The full model's state dict under the base names: adapted weights merged into new tensors (in the
        base weight's dtype, so the dtypes are a full fine-tune's; models/adapter_push.py merge_weight, as an
        engine merges an adapter push), every other tensor the live one. `live` is the base model's state dict
        (its own by default; a sharded trainer's gathered in full)."""
        live = self.base.state_dict() if live is None else live
        state = self._base_state(live)
        for module in self._layers:
            state[f"{module}.weight"] = merge_weight(state[f"{module}.weight"], self._adapter_layer(module, live))
        return state

    @torch.no_grad()
    def push_state(self, live: Mapping[str, torch.Tensor] | None = None, *, base: bool) -> dict[str, torch.Tensor]:
        """An adapter push (models/adapter_push.py): each adapted layer's A, B and scale under its base name, and with
        `base` every tensor of the base model, adapted layers unmerged. The live tensors, not copies (from `live` as
        in merged_state)."""
        live = self.base.state_dict() if live is None else live
        state = self._base_state(live) if base else {}
        for module in self._layers:
            adapter = self._adapter_layer(module, live)
            state.update({f"{module}.lora_A": adapter.a, f"{module}.lora_B": adapter.b,
                          f"{module}.lora_scale": adapter.scale})
        return state

    def _base_state(self, live: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The base model's state dict under its own names (an adapted layer's weight and bias are its base
        layer's), from the wrapped model's live tensors."""
        state = {}
        for name in self._names:
            module, _, leaf = name.rpartition(".")
            state[name] = live[name] if module not in self._layers else live[f"{module}.base_layer.{leaf}"]
        return state

    def _adapter_layer(self, module: str, live: Mapping[str, torch.Tensor]) -> AdapterLayer:
        """A layer's A, B and scale from the given tensors (not the layer's own: a sharded layer holds only its
        shard of them). Adapted layers are nn.Linear (resolve_targets), whose weight is (out, in) as B @ A is."""
        a, b = (live[f"{module}.lora_{side}.{_ADAPTER}.weight"] for side in "AB")
        return AdapterLayer(a, b, torch.tensor(self._layers[module].scaling[_ADAPTER], dtype=torch.float32))

    def save(self, directory: Path, live: Mapping[str, torch.Tensor] | None = None) -> None:
        """The merged model in Hugging Face format into `directory`, the adapter alone into `directory/adapter`
        (from `live` as in merged_state)."""
        directory = Path(directory)
        # save_pretrained empties the dict it is given while writing shards: a fresh one each time.
        self.base.save_pretrained(directory, state_dict=self.merged_state(live), safe_serialization=True)
        adapter = None if live is None else self._adapter(live)
        self.model.save_pretrained(directory / "adapter", safe_serialization=True, state_dict=adapter)

    def state_dict(self, live: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """Settings, adapter tensors (copies: they change at the next step) and the frozen base weights of
        the adapted layers (references: they never change); from `live` as in merged_state."""
        if live is None:
            base = {f"{name}.weight": layer.base_layer.weight.detach() for name, layer in self._layers.items()}
            adapter = {name: param.detach().clone() for name, param in self.trainable}
        else:
            base = {f"{name}.weight": live[f"{name}.base_layer.weight"] for name in self._layers}
            adapter = self._adapter(live)
        return {"settings": {**self.settings.fingerprint(), "targets": list(self.targets)},
                "adapter": adapter, "base": base}

    def _adapter(self, live: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The adapter tensors under the wrapped model's names (peft's, as in `trainable`) from a base state dict."""
        return {name: live[base_name] for name, base_name in self.base_names().items()}

    def base_names(self) -> dict[str, str]:
        """Each trainable parameter's name in the wrapped model -> its name in the base model."""
        in_base = {id(param): name for name, param in self.base.named_parameters()}
        return {name: in_base[id(param)] for name, param in self.trainable}

    def sharded_state(self, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """A state_dict()'s adapter and base tensors as a partial state dict of the base model, for a sharded
        trainer to scatter (checked as load_state_dict checks them)."""
        self._check_settings(state["settings"])
        names = self.base_names()
        # a sharded parameter (a DTensor) has the full tensor's shape: the same check as an unsharded load's
        _check_fits(dict(self.trainable), state["adapter"], what="adapter tensor")
        _check_fits({f"{name}.weight": layer.base_layer.weight for name, layer in self._layers.items()},
                    state["base"], what="base weight")
        base = {f"{name}.base_layer.weight": state["base"][f"{name}.weight"] for name in self._layers}
        return {**base, **{names[name]: tensor for name, tensor in state["adapter"].items()}}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a state_dict(): same settings and targets, or an error naming the field to set."""
        self._check_settings(state["settings"])
        params = dict(self.trainable)
        _copy_into(params, state["adapter"], what="adapter tensor")
        _copy_into({f"{name}.weight": layer.base_layer.weight for name, layer in self._layers.items()},
                   state["base"], what="base weight")

    def _check_settings(self, saved: Mapping[str, Any]) -> None:
        own = {**self.settings.fingerprint(), "targets": list(self.targets)}
        for key, value in own.items():
            if saved.get(key) != value:
                field = "target_modules" if key == "targets" else key
                raise ValueError(f"trainer.lora.{field}: this run has {_shown(value)} but the checkpoint's "
                                 f"adapter was trained with {_shown(saved.get(key))}; resume with the "
                                 "checkpoint's trainer.lora settings")


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return f"{len(value)} adapted layers ({', '.join(value[:2])}, ...)"
    return repr(value)


def _check_fits(own: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor], *, what: str) -> None:
    if own.keys() != saved.keys() or any(own[k].shape != saved[k].shape for k in own):
        odd = sorted(set(own) ^ set(saved)) or [k for k in own if own[k].shape != saved[k].shape]
        raise ValueError(f"the checkpoint's LoRA {what}s do not fit this model (first difference: {odd[0]!r}); "
                         "resume with the model and trainer.lora settings the checkpoint was written with")


def _copy_into(own: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor], *, what: str) -> None:
    _check_fits(own, saved, what=what)
    for name, tensor in saved.items():
        own[name].copy_(tensor)

