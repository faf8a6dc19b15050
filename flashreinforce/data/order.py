"""The fixed data order: which prompt comes at each global position of a run.

Position i = epoch * len(prompts) + j maps to prompts[perm_epoch[j]], where perm_epoch is a
permutation drawn from (seed, epoch) alone. The order is fixed before training (U-RB's data-order
constraint) and a scheduler checkpoints only an integer cursor: nothing else is needed to resume.
"""

from __future__ import annotations

import math
import numbers
import random
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

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


class ContinuedOrder:
    """A task's order from position `start` on: order[k] is the prompt at position start + k of `order`. A later
    stage of a pipeline reads a task's data this way, going on where the stages before it stopped.

    >>> ContinuedOrder(PromptOrder(prompts, seed=0), start=40)[0] == PromptOrder(prompts, seed=0)[40]
    """

    def __init__(self, order: PromptOrder, start: int) -> None:
        if isinstance(start, bool) or not isinstance(start, numbers.Integral) or start < 0:
            raise ValueError(f"ContinuedOrder start must be an int >= 0, got {start!r}")
        self.order, self.start = order, int(start)

    def __getitem__(self, k: int) -> Prompt:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"ContinuedOrder position must be an int >= 0, got {k!r}")
        return self.order[self.start + int(k)]


TaskOrder = PromptOrder | ContinuedOrder
"""One task's prompts by position, as MixedOrder reads them."""


class MixedOrder:
    """order[i] -> Prompt of a weighted mixture of tasks, a pure function of (seed, i), as PromptOrder is.

    Positions come in cycles of W = the sum of the weights made whole numbers (3:1:1 -> 5): cycle c holds
    task t exactly w_t times, in an order shuffled from (seed, c), and task t's k-th position takes its own
    PromptOrder's prompt k. So every W positions follow the weights exactly, any window of them approximately,
    and a resumed run (which keeps only a cursor) sees the same prompt at every position.

    >>> order = MixedOrder({"math": PromptOrder(a, seed=0), "tool": PromptOrder(b, seed=0)}, {"math": 3, "tool": 1},
    ...                    seed=0)
    >>> order.task_at(7), order[7]
    """

    def __init__(self, orders: dict[str, TaskOrder], weights: dict[str, float], *, seed: int) -> None:
        if set(orders) != set(weights) or not orders:
            raise ValueError(f"MixedOrder: tasks {sorted(orders)} and weights {sorted(weights)} must name the same tasks")
        self.orders, self.seed = orders, seed
        self.counts = whole_weights(weights)
        self._base = [name for name in orders for _ in range(self.counts[name])]
        self._cache: tuple[int, list[str]] = (-1, [])

    @property
    def period(self) -> int:
        return len(self._base)

    def cycle(self, c: int) -> list[str]:
        """The tasks of positions [c*W, (c+1)*W), in order."""
        cached, tasks = self._cache
        if cached != c:
            tasks = [self._base[j] for j in _shuffled(len(self._base), f"{self.seed}/mix/{c}")]
            self._cache = (c, tasks)
        return tasks

    def locate(self, i: int) -> tuple[str, int]:
        """(task, position in the task's own order) of global position i."""
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0:
            raise ValueError(f"MixedOrder position must be an int >= 0, got {i!r}")
        c, offset = divmod(int(i), self.period)
        tasks = self.cycle(c)
        task = tasks[offset]
        return task, c * self.counts[task] + tasks[:offset].count(task)

    def task_at(self, i: int) -> str:
        return self.locate(i)[0]

    def positions_before(self, i: int) -> dict[str, int]:
        """How many of the global positions [0, i) each task holds: where each task's own order stands at i."""
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0:
            raise ValueError(f"MixedOrder position must be an int >= 0, got {i!r}")
        c, offset = divmod(int(i), self.period)
        tasks = self.cycle(c)[:offset]
        return {name: c * self.counts[name] + tasks.count(name) for name in self.orders}

    def __getitem__(self, i: int) -> Prompt:
        task, k = self.locate(i)
        return self.orders[task][k]


def whole_weights(weights: dict[str, float], max_period: int = 1000) -> dict[str, int]:
    """Weights as the smallest whole numbers in the same ratio (3, 1, 1 -> 3, 1, 1; 0.7, 0.3 -> 7, 3), each
    share rounded to a denominator of at most max_period; a share below 1/max_period counts as that, so every
    task keeps at least one position a cycle."""
    if any(not w > 0 for w in weights.values()):
        raise ValueError(f"task weights must be > 0, got {weights}")
    total = sum(weights.values())
    fractions = {name: Fraction(w / total).limit_denominator(max_period) or Fraction(1, max_period)
                 for name, w in weights.items()}
    scale = math.lcm(*(f.denominator for f in fractions.values()))
    whole = {name: int(f * scale) for name, f in fractions.items()}
    divisor = math.gcd(*whole.values())
    return {name: n // divisor for name, n in whole.items()}
