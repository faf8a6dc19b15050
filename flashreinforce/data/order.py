"""The fixed data order: which prompt comes at each global position of a run.

Position i = epoch * len(prompts) + j maps to prompts[perm_epoch[j]], where perm_epoch is a
permutation drawn from (seed, epoch) alone. The order is fixed before training (U-RB's data-order
constraint) and a scheduler checkpoints only an integer cursor: nothing else is needed to resume.
"""

from __future__ import annotations

import numbers
import random
from collections import Counter
from collections.abc import Sequence

from flashreinforce.types import Prompt


class PromptOrder:
    """order[i] -> Prompt for every global position i >= 0 (an endless, epoch-by-epoch sequence).

    >>> order = PromptOrder(prompts, seed=0)
    >>> order[0], order.epoch_of(len(prompts))   # first prompt of epoch 0; epoch 1 starts there
    """

    def __init__(self, prompts: Sequence[Prompt], *, seed: int, shuffle: bool = True) -> None:
        if not prompts:
            raise ValueError("PromptOrder needs at least one prompt: the dataset is empty")
        duplicate = next((i for i, n in Counter(p.id for p in prompts).items() if n > 1), None)
        if duplicate is not None:
            raise ValueError(f"prompt id {duplicate!r} appears more than once; ids key the exactly-once "
                             "ledger, so give every prompt a unique id")
        self.prompts = tuple(prompts)
        self.seed = seed
        self.shuffle = shuffle
        self._cache: tuple[int, list[int]] = (-1, [])

    @property
    def epoch_size(self) -> int:
        return len(self.prompts)

    def epoch_of(self, i: int) -> int:
        self._check(i)
        return i // len(self.prompts)

    def index_of(self, i: int) -> int:
        """Index into `prompts` of the prompt at global position i."""
        epoch, j = divmod(self._check(i), len(self.prompts))
        return self.permutation(epoch)[j]

    def permutation(self, epoch: int) -> list[int]:
        """The order of `prompts` within one epoch (a list of indices); the identity when shuffle=False."""
        cached_epoch, perm = self._cache  # one read and one write of a tuple: safe across threads
        if cached_epoch != epoch:
            n = len(self.prompts)
            perm = _shuffled(n, f"{self.seed}/{epoch}") if self.shuffle else list(range(n))
            self._cache = (epoch, perm)
        return perm

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[self.index_of(i)]

    def _check(self, i: int) -> int:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0:
            raise ValueError(f"PromptOrder position must be an int >= 0, got {i!r}")
        return int(i)


def _shuffled(n: int, seed: str) -> list[int]:
    """Fisher-Yates driven by random() alone: Python guarantees that stream for a seed across versions
    (str seeds included), unlike shuffle() or numpy's Generator, so a resumed run sees the same order."""
    rng = random.Random(seed)
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = int(rng.random() * (i + 1))
        order[i], order[j] = order[j], order[i]
    return order
