"""Trajectories -> padded tensors. The only place a TrainBatch is built.

Worked example (pad id 0, two trajectories, prompt lengths 2 and 1):
    tokens      [5, 6, 7, 8]      [9, 4]
    loss_mask   [0, 0, 1, 1]      [0, 1]
  ->
    input_ids      [[5, 6, 7, 8], [9, 4, 0, 0]]
    attention_mask [[1, 1, 1, 1], [1, 1, 0, 0]]
    loss_mask      [[0, 0, 1, 1], [0, 1, 0, 0]]
Every per-token tensor stays aligned with input_ids: column j describes token j.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from flashreinforce.models.packing import Packing, first_fit_decreasing
from flashreinforce.types import FORCED_VERSION, Trajectory


@dataclass(frozen=True)
class TrainBatch:
    input_ids: torch.Tensor  # (B, T) long, right padded
    attention_mask: torch.Tensor  # (B, T) bool
    loss_mask: torch.Tensor  # (B, T) bool
    behavior_logprobs: torch.Tensor  # (B, T) float32, 0 off the loss mask
    policy_versions: torch.Tensor  # (B, T) long, FORCED_VERSION off the loss mask
    rewards: torch.Tensor  # (B,) float32
    group_ids: torch.Tensor  # (B,) long: rows of the same prompt share an id
    failures: torch.Tensor  # (B,) bool: the verifier did not pass the row
    response_lengths: torch.Tensor  # (B,) long: tokens after the prompt, trained or not (masking shortens no row)
    modalities: tuple[str, ...]
    task_ids: torch.Tensor | None = None  # (B,) long: rows of the same task share an id (a mixture's baseline)
    modality_ids: torch.Tensor | None = None  # (B,) long: rows of the same modality share an id (per-modality metrics)
    temperatures: torch.Tensor | None = None  # (B,) float32: each row's sampling temperature; None: the trainer's
    stale_context: torch.Tensor | None = None  # (B,) bool: some token sampled over KV of older weights
    routes: torch.Tensor | None = None  # (B, T, layers, k) int16 MoE routes of the rollout, -1 none; None: dense
    images: tuple[tuple[bytes, ...], ...] = ()  # each row's encoded images (prompt's, observations'); () if none
    episode_ids: torch.Tensor | None = None  # (B,) long: rows of one agent episode (its segments) share an id; None
    # when every row is its own episode
    packing: Packing | None = None  # a microbatch the model reads packed (packed_microbatches); None: as padded

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, start: int, stop: int) -> TrainBatch:
        """Rows [start, stop), trimmed of padding columns that are padding in every kept row."""
        return self._take(slice(start, stop))

    def select(self, rows: torch.Tensor) -> TrainBatch:
        """The rows at these indices (a data-parallel rank's share), trimmed like `rows`; all rows: itself."""
        if rows.numel() == self.num_rows and bool((rows == torch.arange(self.num_rows, device=rows.device)).all()):
            return self
        return self._take(rows)

    def _take(self, index: slice | torch.Tensor) -> TrainBatch:
        if isinstance(index, torch.Tensor):
            index = index.to(self.input_ids.device)
        width = int(self.attention_mask[index].sum(dim=1).max())
        taken = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value[index]
                if value.dim() >= 2:
                    value = value[:, :width]
            elif isinstance(value, tuple) and value:
                value = tuple(value[i] for i in index.tolist()) if isinstance(index, torch.Tensor) else value[index]
            elif isinstance(value, Packing):
                value = None  # it places these rows, not a selection of them
            taken[f.name] = value
        return TrainBatch(**taken)

    def to(self, device: torch.device) -> TrainBatch:
        """Every tensor on `device` (the trainer's); itself when they already are."""
        if self.input_ids.device == torch.device(device):
            return self
        return TrainBatch(**{f.name: (v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
                             for f in fields(self)})

    def microbatches(self, size: int, max_tokens: int | None = None) -> Iterator[tuple[int, TrainBatch]]:
        """(first row index, slice) of at most `size` rows each, consecutive rows in order.

        With `max_tokens`, a slice also stops growing before its padded area (rows x longest row) would pass
        that budget; a row longer than the budget gets a slice of its own. On rows sorted by length this
        packs many short rows together and few long ones, so every slice costs about the same and carries
        little padding.
        """
        lengths = self.attention_mask.sum(dim=1).tolist()
        start = 0
        while start < self.num_rows:
            stop, longest = start + 1, lengths[start]
            while stop < self.num_rows and stop - start < size:
                longest_with_next = max(longest, lengths[stop])
                if max_tokens is not None and (stop - start + 1) * longest_with_next > max_tokens:
                    break
                stop, longest = stop + 1, longest_with_next
            yield start, self.rows(start, stop)
            start = stop

    def packed_microbatches(self, size: int,
                            max_tokens: int | None = None) -> Iterator[tuple[torch.Tensor, TrainBatch]]:
        """(row indices, microbatch) covering every row once, each microbatch packed (models/packing.py): the rows go
        into packed rows as wide as the longest row, first fit decreasing, and a microbatch takes up to `size` packed
        rows, fewer where `max_tokens` would be passed by packed rows x that width (at least one). Its `packing` says
        where each of its rows sits; its other tensors are its rows, padded, as `select` gives them."""
        lengths = self.attention_mask.sum(dim=1).tolist()
        width = max(lengths)
        bins = first_fit_decreasing(lengths, width)
        per_micro = size if max_tokens is None else max(1, min(size, max_tokens // width))
        for start in range(0, len(bins), per_micro):
            group = bins[start: start + per_micro]
            rows = [row for packed in group for row in packed]
            index = torch.tensor(rows, device=self.input_ids.device)
            micro = self._take(index)
            place = {row: i for i, row in enumerate(rows)}
            packing = Packing.of([[place[row] for row in packed] for packed in group], [lengths[row] for row in rows],
                                 micro.input_ids.shape[1], self.input_ids.device)
            yield index, replace(micro, packing=packing)


def collate(trajectories: Sequence[Trajectory], pad_token_id: int,
            task_temperatures: Mapping[str, float] | None = None) -> TrainBatch:
    """Pad trajectories into one batch. Raises ValueError for a row with no policy tokens. `task_temperatures`
    (task name -> its sampling temperature, when a mixture's tasks sample at different ones) gives each row its
    own in `temperatures`."""
    if not trajectories:
        raise ValueError("cannot build a training batch from zero trajectories")
    width = max(len(t.tokens) for t in trajectories)
    rows = len(trajectories)
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.bool)
    loss_mask = torch.zeros((rows, width), dtype=torch.bool)
    behavior = torch.zeros((rows, width), dtype=torch.float32)
    versions = torch.full((rows, width), FORCED_VERSION, dtype=torch.long)
    group_index: dict[int, int] = {}
    group_ids = []
    for row, trajectory in enumerate(trajectories):
        if trajectory.num_policy_tokens == 0:
            raise ValueError(f"trajectory {trajectory.key} has no sampled tokens to train on "
                             "(empty response); the scheduler should not hand it to the trainer")
        n = len(trajectory.tokens)
        input_ids[row, :n] = torch.tensor(trajectory.tokens)
        attention_mask[row, :n] = True
        loss_mask[row, :n] = torch.tensor(trajectory.loss_mask, dtype=torch.bool)
        behavior[row, :n] = torch.tensor(trajectory.behavior_logprobs, dtype=torch.float32)
        versions[row, :n] = torch.tensor(trajectory.policy_versions)
        group_ids.append(group_index.setdefault(trajectory.group, len(group_index)))
    behavior = behavior.masked_fill(~loss_mask, 0.0)
    versions = versions.masked_fill(~loss_mask, FORCED_VERSION)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        behavior_logprobs=behavior,
        policy_versions=versions,
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        group_ids=torch.tensor(group_ids, dtype=torch.long),
        failures=torch.tensor([not t.verdict.passed for t in trajectories], dtype=torch.bool),
        response_lengths=torch.tensor([t.response_length for t in trajectories], dtype=torch.long),
        modalities=tuple(t.prompt.modality for t in trajectories),
        task_ids=_index(t.prompt.task for t in trajectories),
        modality_ids=_index(t.prompt.modality for t in trajectories),
        temperatures=(torch.tensor([task_temperatures[t.prompt.task] for t in trajectories], dtype=torch.float32)
                      if task_temperatures is not None else None),
        stale_context=torch.tensor([t.stale_context for t in trajectories], dtype=torch.bool),
        routes=_collate_routes(trajectories, width),
        images=tuple(t.images for t in trajectories) if any(t.images for t in trajectories) else (),
        episode_ids=_index(t.key for t in trajectories) if len({t.key for t in trajectories}) < rows else None,
    )


def first_rows(ids: torch.Tensor) -> torch.Tensor:
    """The first row of each id, for ids 0..E-1 in order of first appearance: [0, 1, 0, 2] -> [0, 1, 3]."""
    rows = torch.arange(ids.numel(), device=ids.device)
    first = torch.full((int(ids.max()) + 1,), ids.numel(), dtype=torch.long, device=ids.device)
    return first.scatter_reduce(0, ids, rows, reduce="amin")


def _index(names) -> torch.Tensor:
    """Each name's index in order of first appearance: ("b", "a", "b") -> [0, 1, 0]."""
    seen: dict[str, int] = {}
    return torch.tensor([seen.setdefault(name, len(seen)) for name in names], dtype=torch.long)


def _collate_routes(trajectories: Sequence[Trajectory], width: int) -> torch.Tensor | None:
    """(B, T, layers, k) int16 routes, -1 on padding and on rows without any (None when no row has routes)."""
    shapes = {(t.routes.layers, t.routes.top_k) for t in trajectories if t.routes is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"trajectories of one batch carry MoE routes of different shapes {sorted(shapes)}")
    layers, top_k = shapes.pop()
    routes = torch.full((len(trajectories), width, layers, top_k), -1, dtype=torch.int16)
    for row, trajectory in enumerate(trajectories):
        if trajectory.routes is not None:
            recorded = np.frombuffer(trajectory.routes.data, dtype="<i2").reshape(-1, layers, top_k)
            routes[row, : len(recorded)] = torch.from_numpy(recorded.copy())
    return routes
