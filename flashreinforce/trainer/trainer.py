"""Trainer.step: one learner batch -> one optimizer step, with global normalization across microbatches.

The loss is chosen by name from `algorithms.LOSSES`. Advantages, the reward mean, B and the token count
are computed on the whole batch BEFORE it is split into microbatches (normalization is global), so the summed
microbatch gradients equal the full-batch gradient. With one optimizer step per batch, pi_old is the
policy at the start of the step: the first (and only) forward gives it, detached.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashreinforce.algorithms import LOSSES, GlobalNorm, LossInputs
from flashreinforce.algorithms.dapo import overlong_penalty
from flashreinforce.algorithms.advantages import single_row_tasks, within_tasks
from flashreinforce.algorithms.wpsm import QuerySuccess, mean_token_entropy, wpsm_flags, wpsm_weights
from flashreinforce.models.adapter_push import PROBE_IDS, PROBE_LOGPROBS, probe_logprobs, probe_row
from flashreinforce.models.causal_lm import disable_dropout
from flashreinforce.models.cpu_attention import use_fp32_attention
from flashreinforce.models.checkpointing import checkpoint_layers
from flashreinforce.models.logprobs import first_marked, first_marked_rows, packed_token_logprobs, token_logprobs
from flashreinforce.models.moe import RouteRecorder, RouteReplay, route_shape, set_mismatch
from flashreinforce.models.numerics import Numerics
from flashreinforce.models.packing import packing_problem
from flashreinforce.trainer.batching import TrainBatch, collate, first_rows
from flashreinforce.trainer.distributed import Shard
from flashreinforce.trainer.minibatches import OldPass, minibatch_rows, part_norm
from flashreinforce.trainer.lora import LoraAdapter, LoraSettings, attach_lora
from flashreinforce.trainer.mismatch_stats import MismatchTally
from flashreinforce.trainer.optim import build_optimizer
from flashreinforce.trainer.precision import MasterWeights
from flashreinforce.trainer.sharding import (
    SHARDINGS,
    ShardedMasters,
    casts_for_compute,
    full_optimizer_state,
    full_weights,
    load_full_optimizer_state,
    load_full_weights,
    reshard,
    shard_model,
    total_norm,
)
from flashreinforce.trainer.teachers import Teachers
from flashreinforce.types import Trajectory


@dataclass(frozen=True)
class OverlongShaping:
    max_length: int
    cache: int


@dataclass(frozen=True)
class WPSMSettings:
    tau: float
    eta: float
    alpha: float
    positive_only: bool = False
    rate: str = "query"
    """query: each prompt's success rate over all its rollouts trained so far (eq. 4); group: the current group's."""
    min_rollouts: int = 2


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float
    grad_clip: float


def enable_checkpointing(model: torch.nn.Module, router_replay: bool) -> None:
    """Recompute each decoder layer in the backward pass (transformers' own checkpointing, non-reentrant).
    Refused with router replay on an MoE model: the recomputation would route afresh, not replay."""
    if router_replay and route_shape(model) is not None:
        raise ValueError("trainer.gradient_checkpointing=true recomputes each layer in the backward pass, where the "
                         "replayed routes no longer apply: set trainer.router_replay=false for this MoE model, or "
                         "trainer.gradient_checkpointing=false")
    checkpoint_layers(model, {"use_reentrant": False})


class Trainer:
    """Owns the training model, its optimizer and the policy version (optimizer steps taken)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        loss: str,
        loss_options: Mapping[str, Any],
        optimizer: OptimizerSettings,
        microbatch_size: int,
        microbatch_tokens: int | None = None,
        pad_token_id: int,
        temperature: float,
        task_temperatures: Mapping[str, float] | None = None,
        max_new_tokens: int,
        overlong: OverlongShaping | None = None,
        wpsm: WPSMSettings | None = None,
        minibatches: int = 1,
        numerics: Numerics | None = None,
        router_replay: bool = True,
        lora: LoraSettings | None = None,
        device: torch.device | str = "cpu",
        sharding: str = "replicate",
        gradient_checkpointing: bool = False,
        teachers: Teachers | None = None,
        pack: bool = False,
    ) -> None:
        """`numerics`: the trainer's weight format and compute dtype (models/numerics.py); the model is cast
        to it here and its weights become the formatted fp32 masters. `router_replay`: an MoE model's forward
        uses the experts the rollout chose (R3, models/moe.py) when the trajectories carry routes.
        `lora`: train LoRA adapters on a frozen base instead of every weight (trainer/lora.py); `model` is
        wrapped in place, and `weights()` and `save_model` give the merged model under the base's names.
        `device`: where the model computes (moved there here). In a process that joined a torch.distributed
        group (trainer/distributed.py) this is one data-parallel rank: `step` gets the whole batch on every
        rank and the ranks' weights stay identical; `sharding="fsdp"` shards them instead (trainer/sharding.py).
        `gradient_checkpointing`: keep each layer's input only and recompute the layer in the backward pass.
        `task_temperatures`: each task's sampling temperature when a mixture's tasks sample at different ones (every
        row's log-probs are recomputed at its own); None: every row at `temperature`.
        `teachers`: each task's frozen teacher (trainer/teachers.py), for a loss that reads their log-probs (opd);
        they score every row once per batch, before its first optimizer step.
        `pack`: the policy's forward reads each microbatch packed, without padding (models/packing.py), where the
        model allows it (packing_problem); a warning says why where it does not, and it trains padded."""
        if loss not in LOSSES:
            raise ValueError(f"algo.loss={loss!r} is not a known loss; choose one of {sorted(LOSSES)}")
        if LOSSES[loss].needs_teacher != (teachers is not None):
            raise ValueError(f"algo.loss={loss} scores each task's rows with its teacher: name them in teachers:"
                             if teachers is None else f"teachers given, but algo.loss={loss} does not use them")
        if sharding not in SHARDINGS:
            raise ValueError(f"trainer.sharding={sharding!r} is not one of {SHARDINGS}")
        self.device = torch.device(device)
        self.shard = Shard.current()
        self.sharded = sharding == "fsdp" and self.shard.world_size > 1
        numerics = numerics or Numerics()
        self.compute_dtype = numerics.compute_dtype
        self.formats_weights = numerics.formats_weights
        model.to(self.device)  # before the adapters and the masters, which are built on the model's device
        disable_dropout(model)  # before the adapters: trainer.lora.dropout is the adapters' own
        use_fp32_attention(model, self.device, self.compute_dtype)  # a bf16 SDPA backward is slow on a CPU
        if gradient_checkpointing:
            enable_checkpointing(model, router_replay)
        self.lora: LoraAdapter | None = attach_lora(model, lora, numerics) if lora is not None else None
        self.model = self.lora.model if self.lora is not None else model
        self.spec = LOSSES[loss]
        self.advantage_options, loss_options = self.spec.split_options(loss_options, loss)
        self.loss_options = {**self.spec.defaults, **loss_options}
        self.masters = self._build_masters(numerics)
        self.optimizer, self.schedule = build_optimizer(
            self.masters.params,
            lr=optimizer.lr,
            weight_decay=optimizer.weight_decay,
            betas=optimizer.betas,
            warmup_steps=optimizer.warmup_steps,
            total_steps=optimizer.total_steps,
            min_lr_ratio=optimizer.min_lr_ratio,
        )
        self.grad_clip = optimizer.grad_clip
        self.microbatch_size = microbatch_size
        self.microbatch_tokens = microbatch_tokens
        self.pack = pack and _packable(self.model)
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        self.task_temperatures = task_temperatures
        self.max_new_tokens = max_new_tokens
        self.overlong = overlong
        self.wpsm = wpsm
        self.query_success = QuerySuccess()
        """WPSM's per-query success counts (rate=query), kept in the checkpoint and carried across stages."""
        self.minibatches = minibatches
        self.router_replay = router_replay
        self.teachers = teachers
        if teachers is not None:
            teachers.to(self.device)
        self.version = 0

    def _build_masters(self, numerics: Numerics) -> MasterWeights | ShardedMasters:
        """What AdamW steps, sharding the model first when the trainer is sharded. A bf16/fp8 model computes and
        AdamW steps fp32 masters of its weights (precision.py says why). With LoRA the base is already formatted
        and frozen (sharded as it is), and the fp32 adapters are stepped as they are. Sharded fp32 or bf16: the
        fp32 shards are the masters and FSDP casts them for compute; other formats: ShardedMasters."""
        if self.lora is not None:
            if self.sharded:
                shard_model(self.lora.base, compute_dtype=None)
            return MasterWeights(self.model)
        if not self.sharded:
            return MasterWeights(self.model, numerics)
        if casts_for_compute(numerics):
            shard_model(self.model.float(), self.compute_dtype)
            return MasterWeights(self.model)
        return ShardedMasters(self.model, numerics)

    @property
    def _stepped_root(self) -> torch.nn.Module:
        """The module whose parameters AdamW steps, by whose names a sharded checkpoint keys the optimizer state
        and masters: the LoRA base (its adapters), the fp32 copy of formatted shards, or the model."""
        if self.lora is not None:
            return self.lora.base
        return self.masters.shadow if isinstance(self.masters, ShardedMasters) else self.model

    def step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """Train on one learner batch (trainer.minibatches optimizer steps); returns flat metrics. Increments
        `version` once."""
        started = time.perf_counter()
        rollouts = trajectories
        trajectories, batch = self._collate(trajectories)
        splits = minibatch_rows(batch.group_ids, self.minibatches)
        parts = [self._own_microbatches(batch, rows) for rows in splits]
        targets = self._targets(batch, rollouts, trajectories, parts)  # on the whole batch, on every rank
        self.model.train()
        tally = _Tally()
        # theta_old of the parts after the first, before any step moves the weights (the first part's forward is
        # at theta_old itself)
        old = [[None] * len(parts[0])] + [self._old_pass(batch, part, tally) for part in parts[1:]]
        grad_norms = [self._train_part(batch, rows, part, cached, targets, tally, share=1 / len(parts))
                      for rows, part, cached in zip(splits, parts, old)]
        lr = self._advance()
        tally = _Tally.merged(self.shard.gather(tally))
        metrics = {"optim/grad_norm": sum(grad_norms) / len(grad_norms), "optim/lr": lr,
                   **_batch_metrics(batch, trajectories, targets),
                   **tally.metrics(targets.norm.num_tokens), "time/train_seconds": time.perf_counter() - started,
                   **tally.group_metrics({"task": list(dict.fromkeys(t.prompt.task for t in trajectories)),
                                          "modality": list(dict.fromkeys(t.prompt.modality for t in trajectories))},
                                         wpsm=self.wpsm is not None, distill=self.teachers is not None)}
        if targets.teacher_logprobs is not None:
            metrics["time/teacher_seconds"] = targets.teacher_seconds
        if len(parts) > 1:
            metrics.update({"optim/minibatches": float(len(parts)), "optim/grad_norm_max": max(grad_norms)})
        if self.wpsm is not None:
            metrics["wpsm/flagged_fraction"] = tally.wpsm_flagged / batch.num_rows
        metrics.update(_lag_metrics(batch, trained_at=self.version - 1))
        metrics.update(tally.mismatch.metrics(self._gate_delta()))
        return metrics

    @torch.no_grad()
    def first_forward(self, trajectories: Sequence[Trajectory]) -> list[tuple[TrainBatch, torch.Tensor]]:
        """This rank's microbatches of `trajectories`, each with its per-token log-probs (rows x width), as a step's
        first forward reads them (packed where the trainer packs, MoE routes replayed where it replays them), without
        a gradient or a step: theta_old token by token, which a step's metrics only summarize (benchmarks/mismatch.py
        reads it). Not on sharded ranks, whose forwards are collectives that every rank's step enters alike."""
        assert not self.sharded, "first_forward: a sharded trainer's forward is a collective across its ranks"
        _, batch = self._collate(trajectories)
        micros = self._own_microbatches(batch, torch.arange(batch.num_rows, device=self.device))
        return [(micro, self._policy_forward(micro, None)[0]) for _, micro in micros]

    def _collate(self, trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], TrainBatch]:
        """The rows of `trajectories` sorted by length, and their batch on the trainer's device.

        Sorted rows make each microbatch nearly pad-free (measured: 0.45 s -> 0.27 s per step on the default recipe,
        padded) and let a token budget pack them. Normalization is global, so the order of rows changes nothing but
        float rounding. An agent episode of several segments trains each as a row (Trajectory.rows)."""
        rows = sorted((row for t in trajectories for row in t.rows()), key=lambda t: len(t.tokens))
        return rows, collate(rows, self.pad_token_id, self.task_temperatures).to(self.device)

    def _own_microbatches(self, batch: TrainBatch, rows: torch.Tensor) -> list[tuple[torch.Tensor, TrainBatch]]:
        """This rank's share of the rows (of one mini-batch) as microbatches, each with its rows' indices in
        `batch`."""
        own = rows[self.shard.rows(rows.numel()).to(rows.device)]
        if not own.numel():
            return []
        if self.pack:
            return [(own[index].to(self.device), micro) for index, micro
                    in batch.select(own).packed_microbatches(self.microbatch_size, self.microbatch_tokens)]
        return [(own[start: start + micro.num_rows].to(self.device), micro)
                for start, micro in batch.select(own).microbatches(self.microbatch_size, self.microbatch_tokens)]

    def _idle_passes(self, micros: Sequence[Any]) -> int:
        """Sharded, every forward and backward is a collective: each rank runs as many as the busiest (agreed on
        before the first, as collectives must come in the same order on every rank)."""
        return max(self.shard.gather(len(micros))) - len(micros) if self.sharded else 0

    @torch.no_grad()
    def _old_pass(self, batch: TrainBatch, micros: list[tuple[torch.Tensor, TrainBatch]],
                  tally: _Tally) -> list[OldPass]:
        """theta_old's log-probs and entropies of a later mini-batch's microbatches, before any step of the batch."""
        idle = self._idle_passes(micros)  # agreed on before the first forward, which is a collective when sharded
        passes = [OldPass(*(t.detach() for t in self._policy_forward(micro, tally))) for _, micro in micros]
        for _ in range(idle):
            self._idle_forward(batch.rows(0, 1))
        return passes

    def _train_part(self, batch: TrainBatch, rows: torch.Tensor, micros: list[tuple[torch.Tensor, TrainBatch]],
                    old: Sequence[OldPass | None], targets: _Targets, tally: _Tally, share: float) -> float:
        """One optimizer step on one mini-batch, `rows` of the batch (all of them when there is one mini-batch),
        this rank's share of them in `micros`; returns the step's gradient norm."""
        self.model.zero_grad(set_to_none=True)  # the model's, not only the masters': a failed step's bf16 grads
        norm = part_norm(targets.norm, batch.loss_mask, rows)
        idle = self._idle_passes(micros)  # agreed on before the first backward, which is a collective when sharded
        for (micro_rows, micro), cached in zip(micros, old):
            self._backward(micro, micro_rows, targets, norm, tally, cached, share)
        for _ in range(idle):
            self._idle_backward(batch.rows(0, 1))
        return self._apply_gradients()

    def _gate_delta(self) -> float | None:
        """The FlashREINFORCE trust-region delta, None for other losses (they have no sequence gate)."""
        return float(self.loss_options["delta"]) if "delta" in self.loss_options else None

    def _targets(self, batch: TrainBatch, rollouts: Sequence[Trajectory], rows: Sequence[Trajectory],
                 parts: Sequence[Sequence[tuple[torch.Tensor, TrainBatch]]] = ()) -> _Targets:
        """What the loss needs from the WHOLE batch, before it is split: shaped rewards, advantages, normalizers,
        for WPSM each row's query success rate (after counting this batch's `rollouts`; `rows`: the batch's
        rows, one per trajectory or episode segment), and with teachers their log-probs of this rank's rows (in
        `parts`' microbatches)."""
        rewards = batch.rewards
        if self.overlong is not None:
            # The generated length, not the trained one: april's mask_offpolicy un-trains a resumed row's prefix.
            rewards = rewards + overlong_penalty(batch.response_lengths, max_length=self.overlong.max_length,
                                                 cache_length=self.overlong.cache)
        token_counts = batch.loss_mask.sum(dim=1)
        advantages = self._advantages(batch, rewards, token_counts)  # (B,)
        norm = GlobalNorm(num_sequences=batch.num_rows, num_tokens=int(batch.loss_mask.sum()),
                          reward_mean=float(rewards.mean()), max_new_tokens=self.max_new_tokens,
                          per_row_baselines=self.advantage_options.get("baseline") == "task")
        started = time.perf_counter()
        teacher = self._teacher_logprobs(batch, parts, [t.prompt.task for t in rows])
        teacher_seconds = time.perf_counter() - started
        if self.wpsm is None:
            return _Targets(rewards, advantages, norm, None, None, teacher, teacher_seconds)
        return _Targets(rewards, advantages, norm, self._query_accuracy(batch, rollouts, rows),
                        self._advantages_within_tasks(batch, rewards, token_counts, advantages), teacher,
                        teacher_seconds)

    def _teacher_logprobs(self, batch: TrainBatch, parts: Sequence[Sequence[tuple[torch.Tensor, TrainBatch]]],
                          tasks: Sequence[str]) -> torch.Tensor | None:
        """(B, T) this rank's rows scored by their tasks' teachers (0 on other ranks' rows), microbatch by
        microbatch, before any optimizer step moves the weights; None without teachers."""
        if self.teachers is None:
            return None
        scores = torch.zeros_like(batch.behavior_logprobs)
        for rows, micro in (micro for part in parts for micro in part):
            names = [tasks[row] for row in rows.tolist()]
            scores[rows, : micro.input_ids.shape[1]] = self.teachers.score(micro, names, self._temperature(micro))
        return scores

    def _query_accuracy(self, batch: TrainBatch, rollouts: Sequence[Trajectory],
                        rows: Sequence[Trajectory]) -> torch.Tensor:
        """(B,) WPSM's acc_x^t of each row: its prompt's success rate over every rollout of it trained so far, this
        batch's included (each rollout counted once, however many segments it has), or its group's accuracy."""
        if self.wpsm.rate == "group":
            return _group_accuracy(batch)
        self.query_success.add([t.key.prompt_id for t in rollouts], [t.verdict.passed for t in rollouts])
        return self.query_success.rates([t.key.prompt_id for t in rows],
                                        min_rollouts=self.wpsm.min_rollouts).to(batch.rewards.device)

    def _advantages(self, batch: TrainBatch, rewards: torch.Tensor, token_counts: torch.Tensor) -> torch.Tensor:
        """(B,) each row's advantage. The segments of an agent episode count once, as the rollout they are: the
        advantages are taken over episodes (their tokens summed) and each row gets its episode's."""
        ids = batch.episode_ids
        if ids is None:
            return self.spec.advantages(rewards, batch.group_ids, token_counts, task_ids=batch.task_ids,
                                        **self.advantage_options)
        first = first_rows(ids)  # (E,)
        counts = torch.zeros(first.shape, dtype=token_counts.dtype, device=ids.device).index_add_(0, ids, token_counts)
        tasks = None if batch.task_ids is None else batch.task_ids[first]
        return self.spec.advantages(rewards[first], batch.group_ids[first], counts, task_ids=tasks,
                                    **self.advantage_options)[ids]

    def _advantages_within_tasks(self, batch: TrainBatch, rewards: torch.Tensor, token_counts: torch.Tensor,
                                 advantages: torch.Tensor) -> torch.Tensor:
        """(B,) each row's advantage as its task's rows alone would give it, for WPSM's positive_only: a batch-wide
        baseline (the batch mean, REINFORCE++'s whitening) would let one task's rewards decide which of another
        task's rows are positive. One task: the trained advantages themselves."""
        if batch.task_ids is None or torch.unique(batch.task_ids).numel() < 2:
            return advantages

        def alone(rewards: torch.Tensor, group_ids: torch.Tensor, token_counts: torch.Tensor) -> torch.Tensor:
            return self.spec.advantages(rewards, group_ids, token_counts, task_ids=torch.zeros_like(group_ids),
                                        **self.advantage_options)
        return within_tasks(alone, batch.task_ids, rewards, batch.group_ids, token_counts)

    def _backward(self, micro: TrainBatch, rows: torch.Tensor, targets: _Targets, norm: GlobalNorm, tally: _Tally,
                  old: OldPass | None = None, share: float = 1.0) -> None:
        """Forward and backward of one microbatch: its share of its mini-batch's loss, gradients accumulated.
        `old`: theta_old's log-probs and entropies (a later mini-batch); None: this forward is at theta_old."""
        logprobs, entropies = self._policy_forward(micro, tally if old is None else None)
        if old is None:
            old = OldPass(logprobs.detach(), entropies.detach())
        weights = flags = None
        if self.wpsm is not None:
            flags = wpsm_flags(mean_token_entropy(old.entropies, micro.loss_mask), targets.query_accuracy[rows],
                               targets.wpsm_advantages[rows], entropy_bound=self.wpsm.eta,
                               accuracy_threshold=self.wpsm.tau, positive_only=self.wpsm.positive_only)
            weights = wpsm_weights(flags, self.wpsm.alpha)
        teacher = targets.teacher_logprobs
        inputs = LossInputs(policy_logprobs=logprobs, old_logprobs=old.logprobs,
                            behavior_logprobs=micro.behavior_logprobs, loss_mask=micro.loss_mask,
                            advantages=targets.advantages[rows], rewards=targets.rewards[rows],
                            entropies=old.entropies, failures=micro.failures, modalities=micro.modalities,
                            sequence_weights=weights,
                            teacher_logprobs=None if teacher is None else teacher[rows, : micro.input_ids.shape[1]])
        loss, stats = self.spec.objective(inputs, norm, **self.loss_options)
        loss.backward()
        tally.add(micro, loss, stats, old.logprobs, old.entropies, flags, share)
        tally.mismatch.add(micro, old.logprobs, version=self.version)

    @torch.no_grad()
    def _idle_forward(self, micro: TrainBatch) -> None:
        """A forward with nothing kept, so that a sharded rank with fewer microbatches than its peers in the
        theta_old pass still joins their gathers."""
        token_logprobs(self.model, micro.input_ids, micro.attention_mask, temperature=self._temperature(micro),
                       with_entropy=False, images=micro.images)

    def _idle_backward(self, micro: TrainBatch) -> None:
        """A pass whose loss is 0, so that a sharded rank with fewer microbatches than its peers still joins
        their gathers and reduce-scatters; it adds nothing to any gradient."""
        logprobs, _ = token_logprobs(self.model, micro.input_ids, micro.attention_mask,
                                     temperature=self._temperature(micro), with_entropy=False, images=micro.images)
        (logprobs.sum() * 0.0).backward()

    def _temperature(self, micro: TrainBatch) -> float | torch.Tensor:
        """The temperature each row was sampled at: one for all, or per row in a mixture of several."""
        return self.temperature if micro.temperatures is None else micro.temperatures

    def _policy_forward(self, micro: TrainBatch, tally: _Tally | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and entropies; an MoE rollout's routes are replayed (R3) or, with replay off,
        compared with the trainer's own choice (mismatch/route_disagreement either way, into `tally`: the forward
        at theta_old; a later mini-batch's forward passes None). A packed microbatch's forward reads its rows packed,
        their routes packed alike."""
        packing = micro.packing

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            if packing is not None:
                return packed_token_logprobs(self.model, micro.input_ids, micro.attention_mask, packing,
                                             temperature=self._temperature(micro), with_entropy=True,
                                             from_tokens=first_marked_rows(micro.loss_mask))
            return token_logprobs(self.model, micro.input_ids, micro.attention_mask,
                                  temperature=self._temperature(micro), with_entropy=True, images=micro.images,
                                  from_token=first_marked(micro.loss_mask))
        if micro.routes is None:
            return forward()
        routes = micro.routes if packing is None else packing.pack(micro.routes, fill=-1)  # -1: the router's own
        if self.router_replay:
            with RouteReplay(self.model, routes) as replay:
                outputs = forward()
            if tally is not None:
                tally.mismatch.add_routes(*replay.disagreement())
            return outputs
        with RouteRecorder(self.model) as recorder:
            outputs = forward()
        own = recorder.take().view(routes.shape)
        own = own if packing is None else packing.unpack(own, fill=-1)  # (b, T, layers, k)
        recorded = micro.routes[..., 0] >= 0  # (b, T, layers)
        differing = set_mismatch(micro.routes.long(), own.long()) & recorded
        if tally is not None:
            tally.mismatch.add_routes(int(differing.sum()), int(recorded.sum()))
        return outputs

    def _apply_gradients(self) -> float:
        """Clip and take one AdamW step; returns the gradient norm before clipping."""
        self.masters.grads_to_masters()  # clip, report and step in fp32
        if not self.sharded:  # a sharded model's backward already reduce-scattered the sum
            self.shard.sum_gradients(self.masters.params)  # the whole batch's gradient on every rank
        grad_norm = total_norm(torch.nn.utils.clip_grad_norm_(self.masters.params, self.grad_clip))
        if not torch.isfinite(grad_norm):
            raise FloatingPointError(f"non-finite gradient norm {float(grad_norm)} at step {self.version}; "
                                     "lower trainer.lr or check the rewards")
        self.optimizer.step()
        self.masters.copy_to_model()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def _advance(self) -> float:
        """The batch is trained: the schedule and the policy version move once; returns the lr the batch used."""
        lr = self.schedule.get_last_lr()[0]
        self.schedule.step()
        self.version += 1
        return lr

    def weights(self) -> dict[str, torch.Tensor]:
        """The model's weights (what the engine loads at a push); with LoRA the merged ones, under the base
        model's names and shapes. Sharded: a collective, the full weights in the trainer's format on rank 0 and {}
        on the other ranks."""
        if self.sharded and self.lora is not None:
            full = full_weights(self.lora.base)
            return self.lora.merged_state(full) if full else {}
        if self.sharded:
            return {name: tensor.to(self.compute_dtype) if tensor.is_floating_point() else tensor
                    for name, tensor in full_weights(self.model).items()}
        if self.lora is not None:
            return self.lora.merged_state()
        return self.model.state_dict()

    def push_state(self, base: bool = True) -> dict[str, torch.Tensor]:
        """What an engine loads at a push: weights() for a full fine-tune; with LoRA an adapter push
        (models/adapter_push.py: each adapted layer's A, B and scale, every base tensor when `base`, for an engine's
        first push) with this trainer's log-probs of the probe row, which the engine checks its own against. Live
        tensors, not copies. Sharded: a collective (the probe's forward too), the push on rank 0 and {} on the
        other ranks."""
        if self.lora is None or self.lora.settings.push == "merged":
            return self.weights()
        if self.sharded:
            full = full_weights(self.lora.base)
            push = self.lora.push_state(full, base=base) if full else {}
        else:
            push = self.lora.push_state(base=base)
        probe = self._probe()
        return {**push, **probe} if push else {}

    def _probe(self) -> dict[str, torch.Tensor]:
        """The probe row and this model's log-probs of it (eval mode: no adapter dropout)."""
        base = self.lora.base
        ids = torch.tensor(probe_row(base.get_input_embeddings().num_embeddings,
                                     frozenset(getattr(base, "banned_token_ids", ()))))
        training = self.model.training
        self.model.eval()
        try:
            logprobs = probe_logprobs(self.model, ids)
        finally:
            self.model.train(training)
            if self.sharded:  # a forward with no backward after it: the root's parameters stay gathered otherwise
                reshard(self.model)
        return {PROBE_IDS: ids, PROBE_LOGPROBS: logprobs}

    def save_model(self, directory: Path) -> None:
        """The model in Hugging Face format (safetensors); with LoRA the merged model, and the adapter alone
        (peft format) in `directory/adapter`. Sharded: a collective; rank 0 writes."""
        if self.sharded and self.lora is not None:
            full = full_weights(self.lora.base)
            if full:
                self.lora.save(directory, full)
            return
        if self.sharded:
            weights = self.weights()
            if self.shard.rank == 0:
                _save_sharded(self.model, directory, weights, self.compute_dtype)
            return
        if self.lora is not None:
            self.lora.save(directory)
            return
        self.model.save_pretrained(directory, safe_serialization=True)

    def close(self) -> None:
        """Nothing to release in this process; here so a run closes a Trainer and a TrainerProcess alike."""

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs besides the saved model. Sharded: a collective, {} on ranks other than 0."""
        if self.sharded:
            return self._sharded_state()
        state = {
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "version": self.version,
        }
        masters = self.masters.state_dict()
        if masters:  # a bf16 model: the fp32 weights the next step continues from, not the rounded ones
            state["master_weights"] = masters
        if self.query_success.counts:
            state["wpsm_queries"] = self.query_success.state_dict()
        if self.lora is not None:  # the saved model is merged: the adapter and its frozen base come from here
            state["lora"] = self.lora.state_dict()
        return state

    def _sharded_state(self) -> dict[str, Any]:
        """The optimizer's state by parameter name (not by index, as an unsharded one's), and for formatted
        weights (bf16, fp8) the fp32 masters (with LoRA: the adapter and the adapted layers' frozen base instead),
        gathered in full: a resume may use another world size."""
        root = self._stepped_root
        state = {"sharding": "fsdp", "optimizer": full_optimizer_state(root, self.optimizer),
                 "schedule": self.schedule.state_dict(), "version": self.version}
        if self.query_success.counts:
            state["wpsm_queries"] = self.query_success.state_dict()
        if self.lora is not None:  # the adapters are stepped as they are: no masters
            full = full_weights(root)
            state["lora"] = self.lora.state_dict(full) if full else {}
        elif self.formats_weights:
            state["master_weights"] = full_weights(root)
        return state if self.shard.rank == 0 else {}

    def _load_sharded_state(self, state: Mapping[str, Any]) -> None:
        """Collective: every rank gives the same full state (rank 0's `_sharded_state`) and keeps its shards."""
        root = self._stepped_root
        if self.lora is not None:  # the model was built from the merged weights: its adapted layers' are not W
            load_full_weights(root, self.lora.sharded_state(state["lora"]), partial=True)
        elif "master_weights" in state:
            load_full_weights(root, state["master_weights"])
            self.masters.copy_to_model()  # formatted shards from the loaded masters (FSDP's cast needs none)
        self._load_optimizer(state, lambda saved: load_full_optimizer_state(root, self.optimizer, saved))
        self.version = int(state["version"])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.query_success.load_state_dict(state.get("wpsm_queries", {}))
        if set(state) == {"version"}:  # a stage after an sft stage: only the step count carries over
            self.version = int(state["version"])
            return
        written, own = state.get("sharding", "replicate"), "fsdp" if self.sharded else "replicate"
        if written != own:
            raise ValueError(f"trainer.sharding: the checkpoint was written with sharding {written} but this trainer "
                             f"is {own} (fsdp takes effect with trainer.world_size > 1); resume with the checkpoint's "
                             "trainer.sharding and a world size that gives it")
        if ("lora" in state) != (self.lora is not None):
            saved, own = ("LoRA", "full fine-tuning") if "lora" in state else ("full fine-tuning", "LoRA")
            raise ValueError(f"trainer.lora: the checkpoint was written by {saved} but this run does {own}; "
                             "resume with the checkpoint's trainer.lora setting")
        if self.sharded:
            self._load_sharded_state(state)
            return
        if self.lora is not None:
            self.lora.load_state_dict(state["lora"])
        if "master_weights" in state:  # else (fp32, or saved before masters were) they stay the model's weights
            self.masters.load_state_dict(state["master_weights"])
        self._load_optimizer(state, self.optimizer.load_state_dict)
        self.version = int(state["version"])

    def _load_optimizer(self, state: Mapping[str, Any], load: Callable[[Any], None]) -> None:
        """A checkpoint's optimizer and schedule; or, from a stage boundary (a state without a schedule), the
        previous stage's AdamW moments, if it carries them, under this stage's own lr, betas, weight decay and
        fresh schedule: loading a whole optimizer state would bring back the old stage's hyperparameters."""
        if "schedule" in state:
            load(state["optimizer"])
            self.schedule.load_state_dict(state["schedule"])
            return
        if "optimizer" not in state:
            return
        hyperparameters = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        load(state["optimizer"])
        for group, own in zip(self.optimizer.param_groups, hyperparameters):
            group.update(own)


def _save_sharded(model: torch.nn.Module, directory: Path, weights: Mapping[str, torch.Tensor],
                  dtype: torch.dtype) -> None:
    """A sharded model's gathered weights as a Hugging Face checkpoint of its own class (transformers drops the
    FSDP prefix of the class name), whose config names the weights' dtype, not the fp32 of the shards."""
    model.save_pretrained(directory, state_dict=dict(weights), safe_serialization=True)
    config = copy.deepcopy(getattr(model, "vlm_config", model.config))  # a VLM's config.json is its full config
    config.dtype = dtype
    config.save_pretrained(directory)


@dataclass(frozen=True, eq=False)
class _Targets:
    rewards: torch.Tensor  # (B,) task reward + shaping
    advantages: torch.Tensor  # (B,)
    norm: GlobalNorm
    query_accuracy: torch.Tensor | None  # (B,) for WPSM: acc_x^t of each row's query (or its group's accuracy)
    wpsm_advantages: torch.Tensor | None  # (B,) for WPSM's positive_only: each row's within its task
    teacher_logprobs: torch.Tensor | None = None  # (B, T) each row's teacher's log-probs (this rank's rows)
    teacher_seconds: float = 0.0


@dataclass
class _Tally:
    """Sums over the microbatches of one step."""

    loss: float = 0.0
    per_row: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # (b,) stats: concatenated, then averaged
    scalars: dict[str, float] = field(default_factory=dict)  # each slice's share of a batch figure: summed
    entropy: float = 0.0
    abs_mismatch: float = 0.0
    k3_mismatch: float = 0.0
    wpsm_flagged: int = 0
    padded_cells: int = 0
    """(rows x width) actually fed to the model (packed rows x their width for a packed microbatch)."""
    real_cells: int = 0
    mismatch: MismatchTally = field(default_factory=MismatchTally)
    group_rows: list[torch.Tensor] = field(default_factory=list)
    """(b, 9) per row: task id, entropy sum, loss tokens, k3 sum, admitted by the sequence gate (1 without one),
    flagged by WPSM (0 without it), modality id, tokens the mismatch correction masked (IcePop, MISC, ...), and its
    sampled reverse KL to its teacher (opd; 0 without one)."""
    sequence_ratios: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Per modality, each row's geometric-mean mismatch ratio exp(mean_j log(pi_old / mu)): what a sequence-level
    IcePop band (GSPO's seq_icepop) judges, so its distribution shows where a band falls."""

    def add(self, micro: TrainBatch, loss: torch.Tensor, stats: Mapping[str, torch.Tensor], logprobs: torch.Tensor,
            entropies: torch.Tensor, flags: torch.Tensor | None = None, share: float = 1.0) -> None:
        """One microbatch; `share`: its mini-batch's weight in the step's loss and loss stats (1 / mini-batches),
        which are then means over the step's optimizer steps."""
        self.loss += share * float(loss.detach())
        self.padded_cells += micro.attention_mask.numel() if micro.packing is None else micro.packing.cells
        self.real_cells += int(micro.attention_mask.sum())
        for name, value in stats.items():
            if value.dim() == 0:
                self.scalars[name] = self.scalars.get(name, 0.0) + share * float(value)
            else:
                self.per_row.setdefault(name, []).append(value.detach().float().cpu())
        mask = micro.loss_mask
        gap = (logprobs - micro.behavior_logprobs).masked_fill(~mask, 0.0)
        geometric = (gap.sum(-1) / mask.sum(-1).clamp(min=1)).exp().float().cpu()
        for modality in set(micro.modalities):
            chosen = torch.tensor([m == modality for m in micro.modalities])
            self.sequence_ratios.setdefault(modality, []).append(geometric[chosen])
        row_entropy = entropies.masked_fill(~mask, 0.0).sum(-1)
        self.entropy += float(row_entropy.sum())
        self.abs_mismatch += float(gap.abs().sum())
        # k3 estimator of KL(behavior || policy) per token: exp(d) - d - 1 with d = log pi - log mu
        row_k3 = (torch.expm1(gap) - gap).sum(-1)
        self.k3_mismatch += float(row_k3.sum())
        flagged = torch.zeros_like(row_k3) if flags is None else flags.to(row_k3)  # WPSM's
        self.wpsm_flagged += int(flagged.sum())
        if micro.task_ids is not None and micro.modality_ids is not None:
            admitted = stats.get("admitted", torch.ones_like(row_k3)).detach().to(row_k3.dtype)
            masked = stats.get("mismatch/masked_tokens", torch.zeros_like(row_k3)).detach().to(row_k3.dtype)
            teacher_kl = stats.get("sequence_reverse_kl", torch.zeros_like(row_k3)).detach().to(row_k3.dtype)
            self.group_rows.append(torch.stack([micro.task_ids.to(row_k3), row_entropy, mask.sum(-1).to(row_k3),
                                                row_k3, admitted, flagged, micro.modality_ids.to(row_k3), masked,
                                                teacher_kl], dim=1).double().cpu())

    @classmethod
    def merged(cls, tallies: Sequence[_Tally]) -> _Tally:
        """The data-parallel ranks' tallies as one: what a single process would have summed."""
        if len(tallies) == 1:
            return tallies[0]
        total = cls(mismatch=MismatchTally.merged([t.mismatch for t in tallies]))
        for tally in tallies:
            for name in ("loss", "entropy", "abs_mismatch", "k3_mismatch", "wpsm_flagged", "padded_cells",
                         "real_cells"):
                setattr(total, name, getattr(total, name) + getattr(tally, name))
            for name, chunks in tally.per_row.items():
                total.per_row.setdefault(name, []).extend(chunks)
            total.group_rows.extend(tally.group_rows)
            for modality, chunks in tally.sequence_ratios.items():
                total.sequence_ratios.setdefault(modality, []).extend(chunks)
            for name, value in tally.scalars.items():
                total.scalars[name] = total.scalars.get(name, 0.0) + value
        return total

    def metrics(self, num_tokens: int) -> dict[str, float]:
        tokens = max(num_tokens, 1)
        metrics = {"loss/policy": self.loss, "entropy/mean": self.entropy / tokens,
                   "mismatch/abs_logprob_diff": self.abs_mismatch / tokens, "mismatch/k3_kl": self.k3_mismatch / tokens,
                   "batch/padding_fraction": 1.0 - self.real_cells / self.padded_cells}
        for name, chunks in self.per_row.items():
            metrics[f"loss/{name}"] = float(torch.cat(chunks).mean())
        metrics.update({f"loss/{name}": value for name, value in self.scalars.items()})
        metrics.update(self.sequence_ratio_metrics())
        return metrics

    def sequence_ratio_metrics(self) -> dict[str, float]:
        """The rows' geometric-mean mismatch ratios, their min, 1st, 50th and 99th percentiles and max: over all rows
        (mismatch/seq_ratio_*) and, with several modalities, over each one's (modality/<m>/seq_ratio_*)."""
        groups = {"mismatch": [r for chunks in self.sequence_ratios.values() for r in chunks]}
        if len(self.sequence_ratios) > 1:
            groups.update({f"modality/{m}": chunks for m, chunks in sorted(self.sequence_ratios.items())})
        metrics = {}
        for prefix, chunks in groups.items():
            ratios = torch.cat(chunks) if chunks else torch.zeros(0)
            if not ratios.numel():
                continue
            quantiles = torch.quantile(ratios.double(), torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64))
            metrics.update({f"{prefix}/seq_ratio_min": float(ratios.min()), f"{prefix}/seq_ratio_max": float(ratios.max()),
                            **{f"{prefix}/seq_ratio_p{q}": float(v) for q, v in zip(("01", "50", "99"), quantiles)}})
        return metrics

    def group_metrics(self, names: Mapping[str, Sequence[str]], wpsm: bool = False,
                      distill: bool = False) -> dict[str, float]:
        """Entropy, behavior-policy KL (k3) per token, gate rejections, tokens masked by the mismatch correction
        (IcePop, MISC's bands), (with WPSM) flagged rows and (distilling) the reverse KL to the teacher per token,
        per task of a mixture (names["task"], in task-id order) and per modality (names["modality"]), where there
        are several: a modality the policy starts to ignore shows as its own entropy collapse."""
        if not self.group_rows:
            return {}
        rows, metrics = torch.cat(self.group_rows), {}
        for prefix, column in (("task", 0), ("modality", 6)):
            if len(names[prefix]) < 2:
                continue
            for index, name in enumerate(names[prefix]):
                own = rows[rows[:, column] == index]
                tokens = max(float(own[:, 2].sum()), 1.0)
                metrics.update({
                    f"{prefix}/{name}/entropy_mean": float(own[:, 1].sum()) / tokens,
                    f"{prefix}/{name}/mismatch_k3_kl": float(own[:, 3].sum()) / tokens,
                    f"{prefix}/{name}/gate_rejected_fraction": float(1 - own[:, 4].mean()) if len(own) else 0.0,
                    f"{prefix}/{name}/masked_fraction": float(own[:, 7].sum()) / tokens})
                if wpsm:
                    metrics[f"{prefix}/{name}/wpsm/flagged_fraction"] = float(own[:, 5].mean()) if len(own) else 0.0
                if distill:
                    metrics[f"{prefix}/{name}/reverse_kl"] = float(own[:, 8].sum()) / tokens
        return metrics


def _packable(model: torch.nn.Module) -> bool:
    """Whether trainer.pack can pack this model's rows; a warning says why not (it then trains padded)."""
    problem = packing_problem(model)
    if problem is not None:
        warnings.warn(f"trainer.pack: {problem}; this model trains padded (docs/config.md, trainer.pack)", stacklevel=3)
    return problem is None


def _batch_metrics(batch: TrainBatch, trajectories: Sequence[Trajectory], targets: _Targets) -> dict[str, float]:
    """Rewards, advantages, lengths and hints of the learner batch."""
    lengths, advantages = batch.response_lengths, targets.advantages
    metrics = {
        "reward/mean": float(batch.rewards.mean()),
        "reward/shaped_mean": float(targets.rewards.mean()),
        "reward/accuracy": float((~batch.failures).float().mean()),
        "advantage/mean": float(advantages.mean()),
        "advantage/abs_mean": float(advantages.abs().mean()),
        "advantage/zero_fraction": float((advantages == 0).float().mean()),
        "response/length_mean": float(lengths.float().mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_fraction": sum(t.finish_reason == "length" for t in trajectories) / len(trajectories),
        "batch/rows": float(batch.num_rows),
        "batch/policy_tokens": float(targets.norm.num_tokens),
    }
    if targets.norm.per_row_baselines:  # baseline=task: a task alone in the batch has advantage 0
        metrics["advantage/single_row_tasks"] = float(single_row_tasks(batch.task_ids))
    hinted = [t.hint_length for t in trajectories if t.hint_length]
    if hinted:
        metrics["hints/hinted_fraction"] = len(hinted) / len(trajectories)
        metrics["hints/mean_tokens"] = sum(hinted) / len(hinted)
    return metrics


def _group_accuracy(batch: TrainBatch) -> torch.Tensor:
    """(B,) accuracy of each row's whole group, over the full batch (not just the microbatch). A group is one prompt,
    so it never mixes tasks."""
    passed = (~batch.failures).float()
    groups = batch.group_ids
    sums = torch.zeros(int(groups.max()) + 1, device=groups.device).index_add_(0, groups, passed)
    counts = torch.zeros_like(sums).index_add_(0, groups, torch.ones_like(passed))
    return (sums / counts)[groups]


def _lag_metrics(batch: TrainBatch, trained_at: int) -> dict[str, float]:
    """Per-token policy lag (trained_at - version of the token) over the batch's policy tokens."""
    lag = (trained_at - batch.policy_versions)[batch.loss_mask]
    if lag.numel() == 0:
        return {}
    metrics = {"lag/mean": float(lag.float().mean()), "lag/max": float(lag.max())}
    counts = torch.bincount(lag.clamp(min=0))
    for value, count in enumerate(counts.tolist()):
        if count:
            metrics[f"lag/tokens_at_{value}"] = float(count)
    return metrics
