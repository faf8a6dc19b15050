"""reasoning-gym's procedural tasks (an optional extra) as Prompts: train and held-out splits of one distribution.

    make_reasoning_gym_splits({"leg_counting": 1.0}, config={"leg_counting": {"min_animals": 1, "max_animals": 2}},
                              num_train=2000, num_eval=64, seed=1234, instruction=DEFAULT_INSTRUCTION)

Each task (a reasoning-gym dataset name, e.g. basic_arithmetic, leg_counting, gsm_symbolic) is one generator
built from its per-task keyword arguments. Both splits come from that same generator and settings; only the
seed differs. reasoning-gym's item i draws from Random(seed + i), so the train seed s and the held-out seed
s + 2**30 give index ranges that never meet (s < 2**30, and both stay below numpy's 2**32 seed limit).

A task with few distinct problems still draws a held-out question again by chance. The held-out split is drawn
first and keeps distinct questions; training then skips every draw whose question is held out and draws on.
Skipping on the training side, not the held-out side, keeps the held-out split a sample of the task's problems:
basic_arithmetic with 1-2 digits draws half its items from only 242 one-digit problems, and dropping the held-out
items that 2000 training items contain dropped 142 of 256, 133 of the 134 one-digit ones among them, leaving a
held-out set much harder than training (measured 2026-12-01).

An item becomes a one-message chat prompt, the question followed by `instruction` (how to write the answer),
so a chat model's template renders it; ground_truth is reasoning-gym's answer string, data_source the task
name, reference_think the worked solution where the generator has one (gsm_symbolic's metadata.answer_cot).

`import reasoning_gym` imports every task family and their dependencies: it happens only when splits are made.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import random
import zlib
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, NamedTuple

from flashreinforce.types import Prompt

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'flashreinforce[reasoning-gym]'"
DEFAULT_INSTRUCTION = 'Give your final answer at the end, after "The answer is".'
"""What follows every question. "The answer is" is the phrase the math verifier reads first after \\boxed{}."""
EVAL_SEED_OFFSET = 2**30
"""The held-out split's seed is the training seed plus this: their Random(seed + i) streams never overlap."""
RESERVED_KWARGS = frozenset({"seed", "size"})
"""Generator arguments the loader sets itself."""
MAX_DRAWS_PER_ITEM = 10
"""Training gives up (the task has too few problems outside the held-out split) after this many draws an item."""


class TaskSpec(NamedTuple):
    name: str
    weight: float
    """Share of the prompts (weights are normalized over the tasks)."""
    options: dict[str, Any]
    """Keyword arguments of the task's reasoning-gym config (difficulty knobs)."""


class ReasoningGymSplits(NamedTuple):
    train: list[Prompt]
    eval: list[Prompt]
    eval_repeats: int
    """Held-out draws left out because their question came earlier in the held-out split."""
    train_skipped: int
    """Training draws skipped (and replaced by further draws) because their question is held out."""


def import_reasoning_gym() -> ModuleType:
    """The reasoning_gym package, or an error naming the extra that installs it."""
    try:
        import reasoning_gym
    except ImportError as error:
        raise ValueError(f"data.kind=reasoning_gym needs the reasoning-gym package ({error}): {INSTALL_HINT}") from None
    return reasoning_gym


def task_specs(tasks: Sequence[str] | Mapping[str, float], config: Mapping[str, Mapping[str, Any]]) -> list[TaskSpec]:
    """The tasks as (name, weight, generator kwargs): a list means equal weights, a mapping gives each its weight.

    Checks what needs no reasoning-gym: weights, duplicates, and that `config` only configures listed tasks.
    """
    weights = {name: 1.0 for name in tasks} if not isinstance(tasks, Mapping) else dict(tasks)
    if not weights:
        raise ValueError("data.reasoning_gym.tasks is empty: name at least one task, e.g. [basic_arithmetic]")
    if not isinstance(tasks, Mapping) and len(weights) != len(tasks):
        raise ValueError(f"data.reasoning_gym.tasks={list(tasks)} names a task twice; list each once")
    for name, weight in weights.items():
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not weight > 0:
            raise ValueError(f"data.reasoning_gym.tasks.{name}: weight {weight!r}; use a positive number")
    for name, options in config.items():
        if name not in weights:
            raise ValueError(f"data.reasoning_gym.config.{name}: {name!r} is not in data.reasoning_gym.tasks "
                             f"({', '.join(weights)}); add it there or remove its settings")
        reserved = sorted(RESERVED_KWARGS & set(options))
        if reserved:
            raise ValueError(f"data.reasoning_gym.config.{name}: {reserved} are set by the loader (from "
                             "data.reasoning_gym.seed, num_train and num_eval); remove them")
    return [TaskSpec(name, float(weight), dict(config.get(name, {}))) for name, weight in weights.items()]


def check_task_names(names: Sequence[str], known: Sequence[str]) -> None:
    """Unknown task names -> an error with the close matches (a typo) or a pointer to the full list."""
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=4, cutoff=0.6)
            hint = (f"did you mean {', '.join(close)}?" if close
                    else f"there are {len(known)}, e.g. {', '.join(known[:8])}")
            raise ValueError(f"data.reasoning_gym.tasks: unknown reasoning-gym task {name!r}; {hint} (all: "
                             "python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))')")


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """`total` split in proportion to `weights`, largest remainders first: exact counts, the same every time."""
    scale = sum(weights)
    shares = [total * w / scale for w in weights]
    counts = [int(s) for s in shares]
    by_remainder = sorted(range(len(weights)), key=lambda k: (counts[k] - shares[k], k))
    for k in by_remainder[: total - sum(counts)]:
        counts[k] += 1
    return counts


def task_seed(seed: int, task: str) -> int:
    """The task's training seed in [0, 2**30): stable across machines (crc32, not hash()), different per task so
    that two tasks with alike generators (basic_arithmetic, chain_sum) do not draw the same expressions."""
    return zlib.crc32(f"{task}/{seed}".encode()) % EVAL_SEED_OFFSET


def generate(rg: ModuleType, spec: TaskSpec, *, seed: int, size: int, start: int = 0) -> list[dict[str, Any]]:
    """Items start..size-1 of one task; bad generator settings -> an error naming the task and its config's fields."""
    if size <= start:
        return []
    try:
        dataset = rg.create_dataset(spec.name, seed=seed, size=size, **spec.options)
    except (TypeError, AssertionError, ValueError) as error:
        config_cls = rg.factory.DATASETS[spec.name][1]
        fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in RESERVED_KWARGS]
        raise ValueError(f"data.reasoning_gym.config.{spec.name}={spec.options}: reasoning-gym refused it "
                         f"({type(error).__name__}: {error or 'a check failed'}); its settings are {fields}") from None
    return [dataset[i] for i in range(start, size)]


def to_prompt(item: Mapping[str, Any], *, task: str, prompt_id: str, instruction: str) -> Prompt:
    """One reasoning-gym item as a chat Prompt (question + instruction), with its worked solution if any."""
    metadata = item.get("metadata") or {}
    think = metadata.get("answer_cot")
    difficulty = metadata.get("difficulty")
    numeric = isinstance(difficulty, (int, float)) and not isinstance(difficulty, bool)
    content = f"{item['question'].rstrip()}\n\n{instruction}" if instruction else item["question"]
    return Prompt(
        id=prompt_id,
        prompt=({"role": "user", "content": content},),
        ground_truth=str(item["answer"]),
        data_source=task,
        reference_think=think if isinstance(think, str) and think.strip() else None,
        difficulty=float(difficulty) if numeric else None,  # most tasks give a dict of their settings instead
    )


def distinct(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items whose question did not come earlier: held-out problems are distinct."""
    seen: set[str] = set()
    kept = []
    for item in items:
        if item["question"] not in seen:
            seen.add(item["question"])
            kept.append(item)
    return kept


def training_items(rg: ModuleType, spec: TaskSpec, *, seed: int, count: int,
                   avoid: set[str]) -> tuple[list[dict[str, Any]], int]:
    """`count` items in index order, skipping those whose question is in `avoid`; and how many were skipped.

    Items are drawn in growing batches (item i does not depend on the batch), at most MAX_DRAWS_PER_ITEM per item.
    """
    kept: list[dict[str, Any]] = []
    skipped = drawn = 0
    limit = MAX_DRAWS_PER_ITEM * count
    while len(kept) < count:
        if drawn >= limit:
            raise ValueError(f"data.reasoning_gym: only {len(kept)} of {count} training {spec.name} items avoid the "
                             f"held-out questions after {drawn} draws: its settings {spec.options} have too few "
                             "distinct problems; lower num_eval or widen the task's settings")
        size = min(limit, drawn + 2 * (count - len(kept)) + 16)
        for item in generate(rg, spec, seed=seed, size=size, start=drawn):
            if len(kept) == count:
                break
            if item["question"] in avoid:
                skipped += 1
            else:
                kept.append(item)
        drawn = size
    return kept, skipped


def task_splits(rg: ModuleType, spec: TaskSpec, *, num_train: int, num_eval: int, seed: int,
                instruction: str) -> ReasoningGymSplits:
    """One task's distinct held-out items, then its training items, none of which asks a held-out question."""
    train_seed = task_seed(seed, spec.name)
    eval_draws = generate(rg, spec, seed=train_seed + EVAL_SEED_OFFSET, size=num_eval)
    eval_items = distinct(eval_draws)
    train_items, skipped = training_items(rg, spec, seed=train_seed, count=num_train,
                                          avoid={item["question"] for item in eval_items})
    train = [to_prompt(item, task=spec.name, prompt_id=f"{spec.name}/train/{i:06d}", instruction=instruction)
             for i, item in enumerate(train_items)]
    held = [to_prompt(item, task=spec.name, prompt_id=f"{spec.name}/eval/{i:06d}", instruction=instruction)
            for i, item in enumerate(eval_items)]
    return ReasoningGymSplits(train, held, len(eval_draws) - len(eval_items), skipped)


def make_reasoning_gym_splits(
    tasks: Sequence[str] | Mapping[str, float],
    *,
    config: Mapping[str, Mapping[str, Any]],
    num_train: int,
    num_eval: int,
    seed: int,
    instruction: str = DEFAULT_INSTRUCTION,
) -> ReasoningGymSplits:
    """Train and held-out prompts of the weighted tasks, deterministic from (tasks, config, counts, seed).

    Counts per task follow the weights exactly (largest remainder); each split is then shuffled by `seed`
    so that tasks interleave. Ids: "<task>/train/000042", "<task>/eval/000007" (the item's rank in its task's split).
    """
    if num_train < 0 or num_eval < 0:
        raise ValueError(f"num_train={num_train}, num_eval={num_eval}: use counts >= 0")
    specs = task_specs(tasks, config)
    rg = import_reasoning_gym()
    check_task_names([spec.name for spec in specs], sorted(rg.factory.DATASETS))
    weights = [spec.weight for spec in specs]
    splits = [task_splits(rg, spec, num_train=n_train, num_eval=n_eval, seed=seed, instruction=instruction)
              for spec, n_train, n_eval in zip(specs, apportion(num_train, weights), apportion(num_eval, weights))]
    train = [prompt for split in splits for prompt in split.train]
    held = [prompt for split in splits for prompt in split.eval]
    repeats, skipped = sum(split.eval_repeats for split in splits), sum(split.train_skipped for split in splits)
    if repeats or skipped:
        log.info("reasoning_gym: %d of %d held-out draws repeated a question (left out); %d training draws asked "
                 "a held-out question (skipped, drawn again)", repeats, num_eval, skipped)
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(held)
    return ReasoningGymSplits(train, held, repeats, skipped)
