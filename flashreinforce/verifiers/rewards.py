"""Reward functions: the built-in ones and user functions named by a reference string.

A reward function is called once per trajectory:

    def my_reward(completion: str, ground_truth: str, prompt: Prompt) -> float | bool | Verdict

A bool gives reward 1.0 / 0.0; a number r gives Verdict(reward=r, passed=r > 0); a Verdict is kept as
is. A function that scores many rows at once more cheaply than one by one (a model's forward) is batchable:

    my_reward = BatchedRewardFn(score_batch=my_batch, batch_size=16)  # my_batch(completions, ground_truths,
                                                                      #          prompts) -> list, one per row

(or any function with `score_batch` and `batch_size` attributes): the pool then sends it up to batch_size
queued calls at once; each call still gets its own Verdict.

References: a registered verifier by name ("math") or as a JSON spec (verifiers/registry.py),
"path/to/file.py:function" or "package.module:function".
A reference that does not load (missing file, syntax error, no such function, wrong signature) is a
ValueError naming it and the fix, raised when the pool starts, never per call. This module runs
user code in whatever process calls it; verifiers/pool.py is what isolates it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from pathlib import Path

from flashreinforce.user_code import import_file
from flashreinforce.verifiers.registry import (  # noqa: F401 - RewardFn, to_verdict, ...: this module's API too
    FACTORIES,
    BatchedRewardFn,
    RewardFn,
    batch_size_of,
    build_verifier,
    is_spec_ref,
    spec_from_ref,
    to_verdict,
)


def resolve_reward_ref(ref: str) -> str:
    """The canonical form of a reference: a file path made absolute, so worker processes find the same file."""
    if is_spec_ref(ref):
        return ref
    target, colon, name = ref.rpartition(":")
    if not colon or not _is_file(target):
        return ref
    return f"{Path(target).resolve()}:{name}"


def load_reward_fn(ref: str) -> RewardFn:
    """The callable a reference names, checked to take (completion, ground_truth, prompt): a registered
    verifier by name or as a JSON spec (verifiers/registry.py), or a user function in a file or module."""
    if is_spec_ref(ref):
        return build_verifier(spec_from_ref(ref))
    target, colon, name = ref.rpartition(":")
    if not colon or not target or not name:
        raise ValueError(f"reward function {ref!r}: use a registered verifier ({', '.join(sorted(FACTORIES))}), "
                         "'path/to/file.py:function' or 'package.module:function'")
    module = _import_file(ref, Path(target)) if _is_file(target) else _import_module(ref, target)
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"reward function {ref!r}: {target} has no {name!r} (it defines {defined}); fix the name")
    if not callable(fn):
        raise ValueError(f"reward function {ref!r}: {name} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("completion", "ground_truth", None)
    except TypeError as e:
        raise ValueError(f"reward function {ref!r} cannot be called as {name}(completion, ground_truth, prompt) "
                         f"({e}); give it those three positional parameters") from None
    except ValueError:
        pass  # builtins without a signature: the first call will tell
    return fn


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _import_file(ref: str, path: Path) -> object:
    if not path.is_file():
        raise ValueError(f"reward function {ref!r}: file {path} not found (relative to {Path.cwd()}); fix the path")
    try:
        return import_file(path, "reward")
    except Exception as e:
        raise ValueError(f"reward function {ref!r}: importing {path.resolve()} failed with "
                         f"{type(e).__name__}: {e}; fix the file") from e


def _import_module(ref: str, name: str) -> object:
    try:
        return importlib.import_module(name)
    except Exception as e:
        raise ValueError(f"reward function {ref!r}: importing module {name} failed with {type(e).__name__}: {e}; "
                         "check the name and that its package is on sys.path (installed, or in the working "
                         "directory)") from e
