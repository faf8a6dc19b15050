"""The environment protocol of multi-turn episodes, and how a recipe names an environment.

An episode: `reset(prompt, seed)` gives the first observation (appended to the prompt), then each model
turn's text goes to `step(action)`, whose observation is appended to the same token row as forced tokens,
until `done` or a budget ends the episode. Environments are deterministic functions of (prompt, seed,
actions so far): that is what lets a checkpoint hold an in-flight episode as its recorded actions and a
resume rebuild it by replaying them into a freshly reset environment. An observation may show images
(ImageObservation: one IMAGE_TOKEN in its text per image); the worker checks them (check_observation).

Environments run in worker processes (envs/pool.py), so everything here must pickle: the options, the
observations and `info`. `env.kind` names a built-in (ENV_KINDS) or user code, `path/to/my_env.py:MyEnv`.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

from flashreinforce.types import IMAGE_TOKEN, Prompt
from flashreinforce.user_code import import_file

Message = dict[str, str]
"""A chat message, {"role": ..., "content": ...}."""


@dataclass(frozen=True)
class ImageObservation:
    """An observation that shows images: its text holds one IMAGE_TOKEN per image, where the image goes.

        ImageObservation("<image>move:", (png_bytes,))

    The images are encoded (PNG, JPEG, ...), as Prompt.images, and go into the episode's row in placeholder order
    after the prompt's and the earlier observations' images."""

    text: str | list[Message]
    images: tuple[bytes, ...] = ()


Observation = str | list[Message] | ImageObservation
"""Plain text, or messages: several tool results of one step are rendered together (one user turn in a
Qwen-style template, not one per result: slime #2263); either one with images, as an ImageObservation."""


class StepResult(NamedTuple):
    """What `Env.step` returns; a plain (observation, reward, done, info) tuple is accepted too."""

    observation: Observation
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = {}
    """`success` (bool), when given, is the episode's pass/fail flag (the entropy filter's failure flag);
    otherwise an episode passed when its total reward is > 0."""


@runtime_checkable
class Env(Protocol):
    def reset(self, prompt: Prompt, seed: int) -> Observation:
        """Start an episode for `prompt`; `seed` fixes every random choice (a resume replays from it)."""
        ...

    def step(self, action: str) -> StepResult | tuple:
        """Apply one model turn (its decoded text, end-of-turn token removed)."""
        ...

    def close(self) -> None:
        ...


@dataclass(frozen=True)
class EnvSpec:
    """Which environment to build in a worker: `kind` from ENV_KINDS or `file.py:Class`, with its options."""

    kind: str
    options: Mapping[str, Any] = field(default_factory=dict)
    base_dir: str = "."
    """Directory a relative `file.py:Class` is resolved against (the recipe's)."""


ENV_KINDS: dict[str, str] = {
    "python_tool": "flashreinforce.envs.python_tool:PythonToolEnv",
    "text_game": "flashreinforce.envs.text_game:TextGameEnv",
    "visual_grid": "flashreinforce.envs.visual_grid:VisualGridEnv",
    "textworld": "flashreinforce.envs.textworld_env:TextWorldEnv",
    "alfworld": "flashreinforce.envs.textworld_env:ALFWorldEnv",
    "openenv": "flashreinforce.envs.openenv_env:OpenEnvEnv",
}
"""Built-in multi-turn environments (module:class, imported in the worker that runs them)."""


def is_user_env(kind: str) -> bool:
    return ".py:" in kind


def resolve_env_class(spec: EnvSpec) -> type:
    """The class `spec.kind` names; errors say what to write instead."""
    target = ENV_KINDS.get(spec.kind)
    if target is None and not is_user_env(spec.kind):
        known = ["math", "agent", "verifiers", *ENV_KINDS]
        close = difflib.get_close_matches(spec.kind, known, n=1)
        raise ValueError(f"env.kind={spec.kind!r} is not a known environment"
                         f"{f' (did you mean {close[0]!r}?)' if close else ''} ({', '.join(known)}) "
                         "nor user code; write env.kind=path/to/my_env.py:MyEnv")
    if target is not None:
        module_name, _, class_name = target.partition(":")
        module = importlib.import_module(module_name)
    else:
        file, _, class_name = spec.kind.rpartition(":")
        path = (Path(spec.base_dir) / file).resolve()
        if not path.is_file():
            raise ValueError(f"env.kind={spec.kind!r}: no file {path}")
        module = import_file(path, "env")
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"env.kind={spec.kind!r}: {module.__name__} has no class {class_name!r}")
    missing = [m for m in ("reset", "step", "close") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"env.kind={spec.kind!r}: {class_name} lacks {', '.join(missing)} "
                         "(an Env has reset(prompt, seed), step(action) and close())")
    return cls


def build_env(spec: EnvSpec) -> Env:
    """An instance with the spec's options as keyword arguments; a bad option names the class and the option."""
    cls = resolve_env_class(spec)
    try:
        return cls(**dict(spec.options))
    except TypeError as error:
        raise ValueError(f"env.options for {spec.kind!r} do not fit {cls.__name__}: {error}") from error


def as_step_result(value: Any, kind: str) -> StepResult:
    """Coerce what a user's step returned; a wrong shape is the environment's error, named."""
    if isinstance(value, StepResult):
        return value
    if isinstance(value, tuple) and len(value) == 4:
        observation, reward, done, info = value
        if (isinstance(observation, (str, list, ImageObservation)) and isinstance(reward, (int, float))
                and isinstance(done, bool)):
            return StepResult(observation, float(reward), done, dict(info or {}))
    raise TypeError(f"{kind}.step returned {type(value).__name__} {value!r:.120}; it must return (observation: "
                    "str | list of messages | ImageObservation, reward: float, done: bool, info: dict)")


def observation_images(observation: Observation) -> tuple[bytes, ...]:
    """The images an observation shows, in placeholder order (none for plain text or messages)."""
    return observation.images if isinstance(observation, ImageObservation) else ()


def check_observation(observation: Observation, where: str) -> None:
    """One IMAGE_TOKEN per image, and images (bytes) that decode: else a ValueError (TypeError) naming `where`, the
    environment and its turn. Run in the worker, so a bad observation is the environment's error, contained like a
    raise."""
    text = observation.text if isinstance(observation, ImageObservation) else observation
    contents = [text] if isinstance(text, str) else [m.get("content", "") for m in text]
    placeholders = sum(c.count(IMAGE_TOKEN) for c in contents if isinstance(c, str))
    images = observation_images(observation)
    if placeholders != len(images):
        raise ValueError(f"{where}: the observation has {placeholders} {IMAGE_TOKEN} placeholder(s) for {len(images)} "
                         f"image(s); return ImageObservation(text, images) with one {IMAGE_TOKEN} in the text per "
                         "image, where it goes")
    for k, image in enumerate(images):
        _check_image(image, f"{where}: the observation's image {k}")


def _check_image(data: Any, where: str) -> None:
    """The engine decodes the image only later, at its prefill; a bad one found there would stop the run."""
    from PIL import Image, UnidentifiedImageError  # lazy: text environments never need it

    if not isinstance(data, bytes):
        raise TypeError(f"{where} is a {type(data).__name__}; give the encoded bytes (PNG, JPEG, ...)")
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # the header alone opens; a truncated or corrupt body fails only here
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as e:
        raise ValueError(f"{where}: {len(data)} bytes that do not decode as an image ({e})") from None
