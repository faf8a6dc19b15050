"""An engine's side of LoRA adapter pushes (models/adapter_push.py): the adapted layers' base it keeps, what each push
loads, and the probe that checks the push took.

The first push an engine gets from a LoRA trainer is a base push: every tensor of the base model, the adapted
layers' weights unmerged, plus the adapter. The engine loads the base, keeps a copy of the adapted layers' weights
(in the dtype they came in: the trainer's) and loads each adapted weight merged, W + scale * B @ A. Every later push
carries the adapter alone, merged into the kept copy: the base never travels again. Cost: the kept copy (for
SmolLM2-135M with the default targets, 405 MB in fp32) and a merge per push in the engine instead of the trainer.

The probe: each adapter push carries the trainer's log-probs of a fixed probe row at the pushed weights; after
loading, the engine's own must match within a tolerance, else WeightPushError (a push that did not reach the model,
or reached it wrongly, stops the run instead of sampling from weights nobody trains). With fp32 on both sides the
gap is float rounding (~1e-6) and the tolerance PROBE_FLOOR: one missed step of a moving policy fails it. With bf16
or fp8 on either side the gap is a rounding of the weights, which depends on the model and grows as the adapter
does (the engine rounds the merged weight, the trainer the base alone): the tolerance is then the larger of
LOW_PRECISION_FLOOR and PROBE_FACTOR times the gap at the base push, which catches gross failures only (an engine
that never applies the adapter, once the policy has moved), as vLLM's bf16 probe does; `probe.last` holds each
push's gap.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from flashreinforce.models.adapter_push import AdapterPush, merge_weight, probe_logprobs

PROBE_FLOOR = 1e-4
"""The fp32 tolerance: fp32 kernels differ by <= 6.7e-6 on a 30-layer model of SmolLM2's shape (docs/vllm.md)."""
PROBE_FACTOR = 4.0
LOW_PRECISION_FLOOR = 0.5
"""Nats: a bf16 engine's gap to an fp32 forward reaches 0.25 on a 30-layer model (docs/vllm.md's measurements)."""


class WeightPushError(RuntimeError):
    """The engine's log-probs after a push do not match the pushed weights."""


@dataclass(frozen=True)
class ProbeResult:
    error: float
    """max |the engine's probe log-probs - the reference's| (the trainer's, or the vLLM adapter's copy)."""
    tolerance: float


class AdapterBase:
    """The adapted layers' base weights an engine merges each adapter push into."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        """<layer>.weight -> its base (a copy on the engine's device), from the last base push."""

    def loads(self, push: AdapterPush, names: Collection[str], device: torch.device) -> dict[str, torch.Tensor]:
        """The tensors `push` loads into a model whose state dict has `names`: with a base, every base tensor with
        the adapted layers merged (their base kept for later pushes); without, the adapted layers' weights merged
        into the kept base. A ValueError when the push does not fit what the engine holds."""
        adapted = {f"{layer}.weight" for layer in push.layers}
        if push.base:
            missing, unexpected = sorted(set(names) - push.base.keys()), sorted(push.base.keys() - set(names))
            if missing or unexpected or not adapted <= push.base.keys():
                raise ValueError(f"adapter push: its base does not match the engine's model: missing {missing[:5]}, "
                                 f"unexpected {unexpected[:5]}; send the base of the same architecture")
            self.weights = {name: push.base[name].detach().to(device, copy=True) for name in sorted(adapted)}
            loads = dict(push.base)
        elif not self.weights:
            raise ValueError("an adapter push without its base reached an engine that holds none (a new or restarted "
                             "engine, built from merged weights): its first push from a LoRA trainer must be a base "
                             "push (Trainer.push_state(base=True))")
        else:
            loads = {}
        if adapted != self.weights.keys():
            odd = sorted(adapted ^ self.weights.keys())
            raise ValueError(f"adapter push: its adapted layers are not the ones whose base this engine holds (first "
                             f"difference {odd[0]}); push the base again")
        for layer, adapter in push.layers.items():
            name = f"{layer}.weight"
            loads[name] = merge_weight(self.weights[name], adapter)
        return loads

    def forget(self) -> None:
        """A full push replaced every weight: no adapter push may be merged into the old base."""
        self.weights = {}


class PushProbe:
    """Checks each adapter push against the trainer's probe log-probs (see the module's docstring)."""

    def __init__(self, tolerance: float | None = PROBE_FLOOR) -> None:
        """`tolerance`: fixed; None: PROBE_FACTOR times the gap at the last base push, at least LOW_PRECISION_FLOOR
        (bf16 or fp8 on either side)."""
        self.fixed = tolerance
        self.tolerance = tolerance
        self.last: ProbeResult | None = None

    def check(self, model: torch.nn.Module, push: AdapterPush) -> ProbeResult | None:
        """The engine's probe log-probs against the push's; raises WeightPushError past the tolerance. None when the
        push carries no probe."""
        if push.probe is None:
            return None
        ids, expected = push.probe
        error = float((probe_logprobs(model, ids) - expected.double()).abs().max())
        if push.base and self.fixed is None:
            self.tolerance = max(LOW_PRECISION_FLOOR, PROBE_FACTOR * error)
        tolerance = self.tolerance if self.tolerance is not None else PROBE_FLOOR
        self.last = ProbeResult(error, tolerance)
        if not error <= tolerance:
            raise WeightPushError(
                f"the adapter push did not take: the engine's log-probs of the probe row differ from the trainer's at "
                f"the pushed weights by up to {error:.3g} (tolerance {tolerance:.3g}). The engine's weights are not "
                "the trainer's: a push lost or applied to another base (docs/lora.md)")
        return self.last
