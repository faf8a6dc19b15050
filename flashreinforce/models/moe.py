"""Mixture-of-experts routing at the model level: find the routers, record their routes, replay them (R3).

Rollout Routing Replay (ALGORITHMS.md 5.3): the rollout engine records, for every token and every MoE
layer, the top-k experts its router chose; the training forwards then use those experts instead of their
own top-k, so that pi_old and pi_theta are computed through the same experts the sampled tokens went
through. Only the discrete choice is replayed: the gate weights are recomputed from the live router
logits restricted to the recorded set, so the routers keep learning.

Both context managers work with forward hooks on the router modules, so the model code is not patched
and they hold for every forward inside the block (with or without gradient, under inference_mode).

A router is replayed where its module's forward returns `(logits, gate weights, indices)` and the gate
weights of any chosen experts can be recomputed from the logits with the router's own operations
(ROUTER_GATES): Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral, GPT-OSS, DeepSeek-V2 and DeepSeek-V3 (sigmoid scores,
grouped choice, shared experts beside the routed ones). A model that routes where no hook reaches (DBRX chooses its
experts in a method of its MoE block) trains without replay; any other router is refused rather than
replayed with the wrong weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.hooks import RemovableHandle
from transformers.models.dbrx.modeling_dbrx import DbrxRouter
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11; the project supports 3.10

# Config fields that, when > 0, say a model has routed experts (Qwen/OLMoE, Mixtral, DeepSeek).
MOE_CONFIG_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")

INT16_MAX = torch.iinfo(torch.int16).max

GateWeights = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""(router, logits (N, E), chosen experts (N, k)) -> gate weights (N, k): the router's own operations after its
choice, so at the router's own indices the result is bitwise its gate weights, and gradients reach its weight."""


def softmax_gates(router: nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE, Qwen3-MoE, OLMoE: softmax over all experts in float32, renormalised over the k chosen if the
    router does (norm_topk_prob), cast to the logits' dtype."""
    scores = F.softmax(logits, dtype=torch.float, dim=-1).gather(-1, indices)  # (N, k)
    if router.norm_topk_prob:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores.to(logits.dtype)


def mixtral_gates(router: nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Mixtral: softmax in float32, always renormalised over the k chosen, kept in float32."""
    scores = F.softmax(logits.float(), dim=-1).gather(-1, indices)  # (N, k)
    return scores / scores.sum(dim=-1, keepdim=True)


def deepseek_v2_gates(router: nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2: softmax of the float32 logits, scaled by routed_scaling_factor, not renormalised. Its group
    limit only decides the choice: a chosen expert's weight is its own softmax probability either way."""
    return logits.softmax(dim=-1, dtype=torch.float32).gather(-1, indices) * router.routed_scaling_factor


def deepseek_v3_gates(router: nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3: sigmoid scores (the correction bias and the group limit only decide the choice),
    renormalised if norm_topk_prob (with the router's 1e-20), scaled by routed_scaling_factor."""
    scores = logits.sigmoid().gather(1, indices)  # (N, k)
    if router.norm_topk_prob:
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return scores * router.routed_scaling_factor


def gpt_oss_gates(router: nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: softmax over the chosen experts' logits only, in the logits' dtype."""
    return F.softmax(logits.gather(-1, indices), dim=1, dtype=logits.dtype)


ROUTER_GATES: dict[type[nn.Module], GateWeights] = {
    Qwen2MoeTopKRouter: softmax_gates,
    Qwen3MoeTopKRouter: softmax_gates,
    OlmoeTopKRouter: softmax_gates,
    MixtralTopKRouter: mixtral_gates,
    DeepseekV2TopkRouter: deepseek_v2_gates,
    DeepseekV3TopkRouter: deepseek_v3_gates,
    GptOssTopKRouter: gpt_oss_gates,
}
"""The routers recorded and replayed, each with how it weighs a given choice of experts."""
SUPPORTED_ROUTERS: tuple[type[nn.Module], ...] = tuple(ROUTER_GATES)

UNREACHABLE_ROUTING: dict[type[nn.Module], str] = {
    DbrxRouter: "its router module returns logits only and DbrxFFN.route_tokens_to_experts, a method no forward "
                "hook reaches, chooses the experts",
}
"""Routers of MoE families served and trained without replay, with why their routes cannot be reached."""


def check_moe_arguments(
    num_experts: int, experts_per_token: int, intermediate_size: int | None, moe_intermediate_size: int | None
) -> None:
    """A ValueError naming the argument when build_model's mixture-of-experts arguments disagree.

    One expert is refused: a router over one expert routes nothing. Arguments that would silently have
    no effect are refused too (see build_model).
    """
    if num_experts == 0:
        if moe_intermediate_size is not None:
            raise ValueError(f"moe_intermediate_size={moe_intermediate_size} needs num_experts >= 2 (got 0)")
        return
    if num_experts < 2:
        raise ValueError(f"num_experts={num_experts}: use 0 for a dense model or at least 2 experts")
    if not 1 <= experts_per_token <= num_experts:
        raise ValueError(f"experts_per_token={experts_per_token} must lie in [1, num_experts={num_experts}]")
    if intermediate_size is not None:
        raise ValueError(
            f"intermediate_size={intermediate_size} has no effect on a mixture-of-experts model (every layer is "
            "sparse); set moe_intermediate_size, the width of each expert, instead"
        )
    if moe_intermediate_size is not None and moe_intermediate_size < 1:
        raise ValueError(f"moe_intermediate_size={moe_intermediate_size} must be at least 1")


def init_zero_routers(model: nn.Module) -> None:
    """Give all-zero router weights a small random init (normal, std = config.initializer_range).

    Transformers creates router weights as zeros and relies on `_init_weights` to randomise them (5.24
    does). Left at zero, every expert would tie for every token and top-k would pick by index: a
    degenerate model on which routing cannot be tested. build_model calls this under its seeded RNG,
    so the weights stay a function of the seed; it draws nothing when no router is all zeros.
    """
    std = getattr(getattr(model, "config", None), "initializer_range", 0.02)
    for module in model.modules():
        if isinstance(module, SUPPORTED_ROUTERS) and not module.weight.any():
            with torch.no_grad():
                module.weight.normal_(mean=0.0, std=std)


def routing_problem(model: nn.Module) -> str | None:
    """Why router record/replay cannot cover this model, or None (dense, or every router replayable)."""
    routers = [module for module in model.modules() if isinstance(module, SUPPORTED_ROUTERS)]
    config = getattr(model, "config", None)
    says_moe = any((getattr(config, field, 0) or 0) > 0 for field in MOE_CONFIG_FIELDS)
    foreign = [
        module for module in model.modules()
        if "router" in type(module).__name__.lower() and not isinstance(module, SUPPORTED_ROUTERS)
    ]
    name = type(model).__name__
    unreachable = [UNREACHABLE_ROUTING[type(module)] for module in foreign if type(module) in UNREACHABLE_ROUTING]
    if unreachable:
        return f"{name} cannot have its routes recorded or replayed: {unreachable[0]}"
    if foreign or (says_moe and not routers):
        found = f" (routers found: {sorted({type(module).__name__ for module in foreign})})" if foreign else ""
        return (f"{name} is a mixture-of-experts model whose routers are not supported{found}: router record/replay "
                f"is not supported for it (supported routers: {', '.join(cls.__name__ for cls in SUPPORTED_ROUTERS)})")
    return None


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's router modules in layer order ([] for a dense model).

    Raises ValueError (routing_problem) for a model that is MoE but whose routers are not replayable, so a
    caller asking for replay never silently trains with the model's own routes instead.
    """
    problem = routing_problem(model)
    if problem is not None:
        raise ValueError(problem)
    return [module for module in model.modules() if isinstance(module, SUPPORTED_ROUTERS)]


def route_shape(model: nn.Module) -> tuple[int, int] | None:
    """(number of MoE layers, experts per token) or None for a dense model: the (L, k) of a route tensor."""
    routers = moe_routers(model)
    if not routers:
        return None
    top_ks = {router.top_k for router in routers}
    if len(top_ks) != 1:
        raise ValueError(f"{type(model).__name__}: routers disagree on top_k ({sorted(top_ks)}); routes need one k")
    return len(routers), top_ks.pop()


def routers_or_raise(model: nn.Module, what: str) -> list[nn.Module]:
    """moe_routers(model), or a ValueError saying `what` needs an MoE model (dense has nothing to route)."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"{what} needs a mixture-of-experts model; {type(model).__name__} has no routers")
    return routers


def gate_weights(router: nn.Module) -> GateWeights:
    """ROUTER_GATES' function for this router (by class, subclasses included)."""
    return next(gates for cls, gates in ROUTER_GATES.items() if isinstance(router, cls))


def set_mismatch(recorded: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """(N,) bool: whether the SET of experts of each row differs (order within a row does not count)."""
    return (recorded.sort(dim=-1).values != own.sort(dim=-1).values).any(dim=-1)  # (N,)


class _RouterHooks:
    """Forward hooks a context manager registers on entry and removes on exit, even after an exception."""

    handles: list[RemovableHandle]

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class RouteRecorder(_RouterHooks):
    """Captures the experts every router chooses, one (N, L, k) int16 tensor per forward.

    `with RouteRecorder(model) as recorder: model(ids); routes = recorder.take()`. N is the number of
    token positions of that forward (its (B, T) flattened row-major, as the MoE block flattens its
    input), L the MoE layers in order, k the experts per token, in the order the router's top-k returned
    them (descending probability; DeepSeek's is unsorted). take() expects exactly one forward since the
    previous take and raises otherwise: a caller that runs several forwards (a decode loop) takes after
    each, and a silent concatenation could not tell forwards of different shapes apart. Gradient
    checkpointing re-runs the routers in backward, which counts as another forward. The routes stay on the model's device (int16: 2 bytes
    per entry; num_experts must fit). Inside a RouteReplay entered first, it records the replayed routes.
    """

    def __init__(self, model: nn.Module) -> None:
        self.routers = routers_or_raise(model, "RouteRecorder")
        too_many = [r.num_experts for r in self.routers if r.num_experts > INT16_MAX + 1]
        if too_many:
            raise ValueError(f"num_experts={too_many[0]} does not fit int16 routes (at most {INT16_MAX + 1})")
        self.captured: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.handles: list[RemovableHandle] = []

    def __enter__(self) -> Self:
        for layer, router in enumerate(self.routers):
            self.handles.append(router.register_forward_hook(self.hook_for(layer)))
        return self


    def hook_for(self, layer: int) -> Callable:
        """The forward hook of router `layer`: keep its chosen indices (no replacement of the output)."""

        def hook(module: nn.Module, args: tuple, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
            self.captured[layer].append(output[2].detach().to(torch.int16))  # (N, k)

        return hook

    def take(self) -> torch.Tensor:
        """(N, L, k) int16 routes of the one forward since the last take; clears them."""
        counts = [len(per_layer) for per_layer in self.captured]
        if set(counts) != {1}:
            self.captured = [[] for _ in self.routers]
            raise RuntimeError(
                f"RouteRecorder.take expects exactly one forward since the last take; the routers ran {counts} "
                "times (take after every forward)"
            )
        per_layer = [captured[0] for captured in self.captured]  # L x (N, k)
        self.captured = [[] for _ in self.routers]
        return torch.stack(per_layer, dim=1)  # (N, L, k)


@dataclass(frozen=True)
class RouteTally:
    """One router call's count of replayed (token, layer) pairs and of those whose expert set differed."""

    mismatched: torch.Tensor  # () int64, on the model's device: summed lazily, so no sync per layer
    replayed: torch.Tensor  # () int64


def check_routes(routes: torch.Tensor, num_layers: int, top_k: int, num_experts: int) -> torch.Tensor:
    """`routes` (B, T, L, k) validated and as int64 (what the experts take); a ValueError saying what is wrong.

    A (token, layer) row is either all -1 (no recorded route: the router's own choice) or k distinct
    experts in [0, num_experts): a half-recorded row or a repeated expert cannot come from a top-k.
    """
    if routes.is_floating_point() or routes.is_complex() or routes.dtype == torch.bool:
        raise ValueError(f"routes must be an integer tensor, got {routes.dtype}")
    if routes.dim() != 4 or tuple(routes.shape[2:]) != (num_layers, top_k):
        raise ValueError(
            f"routes of shape {tuple(routes.shape)} should be (B, T, L={num_layers}, k={top_k}) for this model"
        )
    routes = routes.long()
    missing = routes == -1  # (B, T, L, k)
    if bool(((routes < -1) | (routes >= num_experts)).any()):
        raise ValueError(f"routes hold expert indices outside [0, {num_experts}) other than -1 (no route)")
    if bool((missing.any(dim=-1) != missing.all(dim=-1)).any()):
        raise ValueError("routes: a (token, layer) row must be all -1 (no recorded route) or k experts, not mixed")
    ordered = routes.sort(dim=-1).values  # (B, T, L, k)
    repeated = (ordered[..., 1:] == ordered[..., :-1]) & ~missing[..., 1:]  # (B, T, L, k-1)
    if bool(repeated.any()):
        raise ValueError("routes: a (token, layer) row names the same expert twice")
    return routes


class RouteReplay(_RouterHooks):
    """Replays recorded routes in every forward inside the block (R3): the experts used are the recorded ones.

    `with RouteReplay(model, routes): model(ids)` with routes (B, T, L, k) aligned with ids (B, T); -1
    rows keep the router's own choice. The gate weights come from the live logits (ROUTER_GATES), so
    replaying the router's own routes is bitwise a plain forward and router weights get gradients. Every
    forward inside must have input (B, T); several forwards (pi_old recompute, then the update) reuse
    the routes. disagreement() counts how often the recorded set differed from the router's own.
    """

    def __init__(self, model: nn.Module, routes: torch.Tensor) -> None:
        self.model = model
        self.routers = routers_or_raise(model, "RouteReplay")
        num_experts = {router.num_experts for router in self.routers}
        if len(num_experts) != 1:
            raise ValueError(f"routers disagree on num_experts ({sorted(num_experts)})")
        num_layers, top_k = route_shape(model)
        self.routes = check_routes(routes, num_layers, top_k, num_experts.pop())  # (B, T, L, k)
        self.flat = self.routes.reshape(-1, num_layers, top_k)  # (B*T, L, k), as the MoE block flattens
        self.per_layer: list[torch.Tensor] = []  # L x (B*T, k), each on its router's device
        self.gates = [gate_weights(router) for router in self.routers]
        self.tallies: list[RouteTally] = []
        self.handles: list[RemovableHandle] = []

    def __enter__(self) -> Self:
        # Moved here, not in the hook: a copy made under inference_mode could not serve a later grad forward.
        self.per_layer = [self.flat[:, layer].to(router.weight.device) for layer, router in enumerate(self.routers)]
        self.handles.append(self.model.register_forward_pre_hook(self.check_input, with_kwargs=True))
        for layer, router in enumerate(self.routers):
            self.handles.append(router.register_forward_hook(self.hook_for(layer)))
        return self


    def check_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Refuse a forward whose tokens are not the routes' (B, T): the flat N alone lets (2, 3) pass as (3, 2)."""
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None and kwargs.get("inputs_embeds") is not None:
            tokens = kwargs["inputs_embeds"][..., 0]
        if tokens is not None and tuple(tokens.shape[:2]) != tuple(self.routes.shape[:2]):
            raise ValueError(
                f"RouteReplay: routes cover (B, T) = {tuple(self.routes.shape[:2])} but the forward's input is "
                f"{tuple(tokens.shape[:2])}"
            )

    def hook_for(self, layer: int) -> Callable:
        """The forward hook of router `layer`: its output with the recorded indices and their live scores."""

        def hook(module: nn.Module, args: tuple, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
            logits, _, own = output  # (N, E), (N, k), (N, k)
            recorded = self.per_layer[layer].to(own.device)  # (N, k); a no-op on the router's device
            if own.shape[0] != recorded.shape[0]:
                raise ValueError(
                    f"RouteReplay: routes cover {recorded.shape[0]} token positions but router {layer} saw "
                    f"{own.shape[0]}"
                )
            has_route = recorded[:, 0] >= 0  # (N,)
            chosen = torch.where(has_route[:, None], recorded, own)  # (N, k)
            mismatched = (set_mismatch(chosen, own) & has_route).sum()
            self.tallies.append(RouteTally(mismatched=mismatched, replayed=has_route.sum()))
            return logits, self.gates[layer](module, logits, chosen), chosen

        return hook

    def disagreement(self) -> tuple[int, int]:
        """(pairs whose recorded expert set differed from the router's own, pairs with a recorded route).

        Summed over the (token, layer) pairs of every forward inside the block so far (a forward that
        gradient checkpointing re-runs in backward counts twice, in both numbers). Syncs the device once.
        """
        if not self.tallies:
            return 0, 0
        mismatched = torch.stack([tally.mismatched for tally in self.tallies]).sum()
        replayed = torch.stack([tally.replayed for tally in self.tallies]).sum()
        self.tallies = [RouteTally(mismatched=mismatched, replayed=replayed)]
        return int(mismatched), int(replayed)
