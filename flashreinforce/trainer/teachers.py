"""Frozen teachers of on-policy distillation, scoring the student's own tokens in the trainer's process.

Each task has one teacher (several tasks may share one: multi-teacher distillation is each task's rows scored by
its own expert). A teacher is a causal LM in eval mode, without gradients, in its own precision; it never
generates. It scores with the trainer's own log-prob forward (models/logprobs.py) at each row's sampling
temperature, on the rows padded, so a teacher equal to the student gives exactly the student's recomputed log-probs
and a zero signal (with trainer.pack the student's packed forward agrees to float rounding).
What it knows nothing about: where a teacher comes from and whether its vocabulary is the student's
(run/teachers.py checks that when it loads one), and the loss (algorithms/distill.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from flashreinforce.models.cpu_attention import use_fp32_attention
from flashreinforce.models.logprobs import first_marked, token_logprobs
from flashreinforce.trainer.batching import TrainBatch


class Teachers:
    """Task name -> frozen teacher model; `score` gives each row the log-probs of its task's teacher."""

    def __init__(self, by_task: Mapping[str, torch.nn.Module]) -> None:
        self.by_task = dict(by_task)
        for model in self.models:
            model.eval()  # no dropout, as the engine samples the student
            model.requires_grad_(False)

    @property
    def models(self) -> list[torch.nn.Module]:
        """Each distinct teacher once."""
        return list({id(model): model for model in self.by_task.values()}.values())

    def to(self, device: torch.device | str) -> Teachers:
        device = torch.device(device)
        for model in self.models:
            model.to(device)
            use_fp32_attention(model, device, model.dtype)  # as the trainer's student attends: equal models agree
        return self

    @torch.no_grad()
    def score(self, micro: TrainBatch, tasks: Sequence[str], temperature: float | torch.Tensor) -> torch.Tensor:
        """(b, T) log pi_T of every token of `micro` (0 where token_logprobs gives none), each row by the teacher of
        its task (`tasks`, one name per row); `temperature` one for all rows or (b,) per row."""
        missing = sorted(set(tasks) - set(self.by_task))
        if missing:
            raise ValueError(f"no teacher for task {missing[0]!r} (teachers are for {sorted(self.by_task)})")
        scores = torch.zeros(micro.input_ids.shape, dtype=torch.float32, device=micro.input_ids.device)
        for model, rows in self._rows_by_teacher(tasks):
            index = torch.tensor(rows, device=micro.input_ids.device)
            part = micro.select(index)
            logprobs, _ = token_logprobs(model, part.input_ids, part.attention_mask,
                                         temperature=temperature[index] if isinstance(temperature, torch.Tensor)
                                         else temperature, with_entropy=False, images=part.images,
                                         from_token=first_marked(part.loss_mask))
            scores[index, : logprobs.shape[1]] = logprobs.float()
        return scores

    def _rows_by_teacher(self, tasks: Sequence[str]) -> list[tuple[torch.nn.Module, list[int]]]:
        """The rows each distinct teacher scores, in order of first appearance."""
        groups: dict[int, tuple[torch.nn.Module, list[int]]] = {}
        for row, task in enumerate(tasks):
            model = self.by_task[task]
            groups.setdefault(id(model), (model, []))[1].append(row)
        return list(groups.values())
