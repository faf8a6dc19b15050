"""Train/inference mismatch as the trainer sees it each step, beside the loss's own statistics.

`mismatch/abs_logprob_diff` (trainer.py) compares behavior and recomputed log-probs over every policy token,
so it mixes numerics with policy lag (a token sampled two steps ago differs because the weights moved). The
figures here separate them:
    mismatch/same_weights_abs_mean, _max   |log mu - log pi_old| over tokens sampled by the very weights the
                                           trainer recomputes with (lag 0), in rows no in-flight weight update
                                           touched (Generation.stale_context): numerics alone (kernels,
                                           precision, routing); _tokens counts them
    mismatch/seq_kl_mean, _p50, _p90, _max the FlashREINFORCE sequence Bernoulli KL D_i of every row (lag
                                           included: it is what the trust region gates on)
    mismatch/gate_rejected_fraction        rows with D_i > delta (FlashREINFORCE only)
    mismatch/route_disagreement            MoE: (token, layer) routes whose expert set differs between the
                                           rollout and the trainer's router, given the forward's hidden states
                                           (with replay these follow the recorded experts of earlier layers, so
                                           the figure is how often replay overrode the router)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from flashreinforce.algorithms.flashreinforce import sequence_bernoulli_kl
from flashreinforce.trainer.batching import TrainBatch


@dataclass
class MismatchTally:
    """Sums over the microbatches of one step."""

    same_weights_abs: float = 0.0
    same_weights_max: float = 0.0
    same_weights_tokens: int = 0
    sequence_kl: list[torch.Tensor] = field(default_factory=list)
    routes_differing: int = 0
    routes_total: int = 0

    def add(self, micro: TrainBatch, logprobs: torch.Tensor, *, version: int) -> None:
        """One microbatch: `logprobs` (b, T) recomputed by weights of `version` (the policy before this step)."""
        mask = micro.loss_mask
        current = logprobs.masked_fill(~mask, 0.0)
        gap = (current - micro.behavior_logprobs).abs()  # (b, T), 0 off the mask
        same = mask & (micro.policy_versions == version)
        if micro.stale_context is not None:
            same &= ~micro.stale_context[:, None]  # an in-flight update left older weights' KV under the token
        if bool(same.any()):
            self.same_weights_abs += float(gap[same].sum())
            self.same_weights_max = max(self.same_weights_max, float(gap[same].max()))
            self.same_weights_tokens += int(same.sum())
        lengths = mask.sum(-1).clamp_min(1)
        self.sequence_kl.append(sequence_bernoulli_kl(micro.behavior_logprobs, current, lengths).float().cpu())

    @classmethod
    def merged(cls, tallies: Sequence[MismatchTally]) -> MismatchTally:
        """Data-parallel ranks' tallies as one (their sums added, the maximum of their maxima)."""
        return cls(same_weights_abs=sum(t.same_weights_abs for t in tallies),
                   same_weights_max=max(t.same_weights_max for t in tallies),
                   same_weights_tokens=sum(t.same_weights_tokens for t in tallies),
                   sequence_kl=[chunk for t in tallies for chunk in t.sequence_kl],
                   routes_differing=sum(t.routes_differing for t in tallies),
                   routes_total=sum(t.routes_total for t in tallies))

    def add_routes(self, differing: int, total: int) -> None:
        self.routes_differing += differing
        self.routes_total += total

    def metrics(self, delta: float | None) -> dict[str, float]:
        metrics: dict[str, float] = {"mismatch/same_weights_tokens": float(self.same_weights_tokens)}
        if self.same_weights_tokens:
            metrics["mismatch/same_weights_abs_mean"] = self.same_weights_abs / self.same_weights_tokens
            metrics["mismatch/same_weights_abs_max"] = self.same_weights_max
        if self.sequence_kl:
            kl = torch.cat(self.sequence_kl)  # (B,)
            quantiles = torch.quantile(kl, torch.tensor([0.5, 0.9]))
            metrics.update({"mismatch/seq_kl_mean": float(kl.mean()), "mismatch/seq_kl_p50": float(quantiles[0]),
                            "mismatch/seq_kl_p90": float(quantiles[1]), "mismatch/seq_kl_max": float(kl.max())})
            if delta is not None:
                metrics["mismatch/gate_rejected_fraction"] = float((kl > delta).float().mean())
        if self.routes_total:
            metrics["mismatch/route_disagreement"] = self.routes_differing / self.routes_total
        return metrics
