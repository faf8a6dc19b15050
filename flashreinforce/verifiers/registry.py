"""The unified verifier system: every verifier by name, built from a spec, called as a reward function.

A spec is what a recipe writes after `verifier:`: a name (`math`), or a mapping with `kind` and the verifier's
options (`{kind: ifeval, all: true}`), or a route by data_source (`{route: {gsm8k: math, ifeval: ifeval}}`), or
a weighted sum (`{kind: sum, parts: [{kind: math, weight: 0.9}, {kind: format, weight: 0.1}]}`). Every built
verifier has the signature of a user reward function, (completion, ground_truth, prompt) -> Verdict, so the
verifier pool runs them all the same way, in its worker processes, by reference string (`spec_ref`).

A verifier's options are the keyword-only parameters of its factory: `build_verifier` checks them against the
signature, so an unknown option is an error naming it and the ones there are. Factories are imported when first
built: a worker that scores math never imports the reward-model code.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flashreinforce.types import Prompt, Verdict

RewardFn = Callable[[str, str, Prompt], Any]
"""(completion, ground_truth, prompt) -> float | bool | Verdict.

A RewardFn that also has `score_batch(completions, ground_truths, prompts) -> list` (one result per row, in order)
and `batch_size` (an int >= 1) is batchable: the pool sends it up to batch_size queued calls at once, through
score_batch (BatchedRewardFn is one; so is any function given those two attributes)."""

DEFAULT_BATCH_SIZE = 8
"""Rows per score_batch call of a batchable RewardFn that states no batch_size."""


@dataclass(frozen=True)
class BatchedRewardFn:
    """A batchable RewardFn: a call scores one row through score_batch, so one row and a batch score alike."""

    score_batch: Callable[[Sequence[str], Sequence[str], Sequence[Prompt]], list[Any]]
    batch_size: int = DEFAULT_BATCH_SIZE

    def __post_init__(self) -> None:
        check_batch_size(self.batch_size)

    def __call__(self, completion: str, ground_truth: str, prompt: Prompt) -> Any:
        return self.score_batch([completion], [ground_truth], [prompt])[0]


def check_batch_size(batch_size: object) -> int:
    """batch_size as given, or a ValueError naming it (a factory checks it before loading a model)."""
    if not (isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size >= 1):
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1 (the rows scored in one call)")
    return batch_size


def batch_size_of(fn: RewardFn) -> int:
    """How many calls the pool may send `fn` at once: its batch_size when it has a score_batch, else 1."""
    if not callable(getattr(fn, "score_batch", None)):
        return 1
    return check_batch_size(getattr(fn, "batch_size", DEFAULT_BATCH_SIZE))

FACTORIES: dict[str, str] = {
    "math": "flashreinforce.verifiers.math:math_verifier",
    "choice": "flashreinforce.verifiers.text:choice_verifier",
    "exact": "flashreinforce.verifiers.text:exact_verifier",
    "regex": "flashreinforce.verifiers.text:regex_verifier",
    "format": "flashreinforce.verifiers.text:format_verifier",
    "code": "flashreinforce.verifiers.code:code_verifier",
    "ifeval": "flashreinforce.verifiers.ifeval:ifeval_verifier",
    "reward_model": "flashreinforce.verifiers.reward_model:reward_model_verifier",
    "judge": "flashreinforce.verifiers.judge:judge_verifier",
    "sum": "flashreinforce.verifiers.registry:sum_verifier",
    "route": "flashreinforce.verifiers.registry:route_verifier",
}
"""Verifier name -> "module:factory". A factory takes the verifier's options as keyword-only arguments and
returns a RewardFn."""


@dataclass(frozen=True)
class VerifierSpec:
    """One verifier with its options, as parsed from a recipe (hashable; options hold JSON values)."""

    kind: str
    options: tuple[tuple[str, Any], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dict(self.options)}


def parse_spec(value: str | Mapping[str, Any], *, field: str = "verifier") -> VerifierSpec:
    """A recipe's `verifier:` value as a VerifierSpec; a kind no factory has is an error listing the names."""
    if isinstance(value, str):
        kind, options = value, {}
    elif isinstance(value, Mapping):
        options = dict(value)
        if "route" in options and "kind" not in options:
            options["kind"] = "route"
        kind = options.pop("kind", None)
        if not isinstance(kind, str):
            raise ValueError(f"{field}: a mapping needs `kind` (one of {sorted(FACTORIES)}) or `route`, got {value!r}")
    else:
        raise ValueError(f"{field}: a verifier name or a mapping with `kind`, got {value!r}")
    if kind not in FACTORIES:
        raise ValueError(f"{field}: unknown verifier {kind!r}; the registered ones: {', '.join(sorted(FACTORIES))}")
    try:
        json.dumps(options, sort_keys=True)
    except TypeError as error:
        raise ValueError(f"{field}: the options of {kind} must be plain values (JSON): {error}") from None
    return VerifierSpec(kind, tuple(sorted(options.items())))


def spec_ref(spec: VerifierSpec) -> str:
    """The reference string the verifier pool passes to its workers: the name alone without options, else the
    spec as canonical JSON (which rewards.load_reward_fn turns back into the verifier)."""
    return spec.kind if not spec.options else json.dumps(spec.as_dict(), sort_keys=True, separators=(",", ":"))


def is_spec_ref(ref: str) -> bool:
    return ref in FACTORIES or ref.startswith("{")


def spec_from_ref(ref: str) -> VerifierSpec:
    return parse_spec(json.loads(ref) if ref.startswith("{") else ref)


def factory(kind: str) -> Callable[..., RewardFn]:
    module, _, name = FACTORIES[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def build_verifier(spec: VerifierSpec | str | Mapping[str, Any], *, field: str = "verifier") -> RewardFn:
    """The RewardFn of a spec; its options are checked against the factory's keyword-only parameters."""
    if not isinstance(spec, VerifierSpec):
        spec = parse_spec(spec, field=field)
    make, options = factory(spec.kind), dict(spec.options)
    allowed = [p.name for p in inspect.signature(make).parameters.values() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{field}: {spec.kind} has no option {', '.join(map(repr, unknown))}; its options: "
                         f"{', '.join(allowed) or 'none'}")
    try:
        return make(**options)
    except (TypeError, ValueError) as error:  # a required option missing, or an option's value refused
        raise ValueError(f"{field}: {spec.kind}: {error}") from None


def to_verdict(value: object) -> Verdict:
    """A reward function's return value as a Verdict; a value of the wrong kind is an error verdict."""
    if isinstance(value, Verdict):
        if _finite(value.reward) and isinstance(value.passed, bool) and isinstance(value.reason, str):
            return value
    elif isinstance(value, bool):
        return Verdict(reward=float(value), passed=value, reason="ok" if value else "wrong")
    elif _finite(value):  # numpy scalars included
        return Verdict(reward=float(value), passed=value > 0, reason="ok" if value > 0 else "wrong")
    return Verdict(reward=0.0, passed=False,
                   reason=f"error: reward function returned {value!r} ({type(value).__name__}); "
                          "return a finite float, a bool or a Verdict(reward: float, passed: bool, reason: str)")


def check_bool_options(kind: str, **options: object) -> None:
    """A verifier factory's yes/no options, each true or false (YAML's `yes` or 1 is refused, naming it)."""
    for name, value in options.items():
        if not isinstance(value, bool):
            raise ValueError(f"{kind}: option `{name}` is {value!r}; use true or false")


def _finite(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


# ---- combinators ------------------------------------------------------------------------------------------

def sum_verifier(*, parts: Sequence[Mapping[str, Any]]) -> RewardFn:
    """A weighted sum of verifiers: reward = sum of weight * part reward; passed when every part passed; the
    Verdict keeps each part's reward by name (`name`, else its kind) for the metrics."""
    if not parts:
        raise ValueError("sum: `parts` is empty; give a list of {kind: NAME, weight: W, ...}")
    built = []
    for index, part in enumerate(parts):
        options = dict(part)
        weight, name = float(options.pop("weight", 1.0)), options.pop("name", options.get("kind"))
        built.append((str(name), weight, build_verifier(options, field=f"sum.parts[{index}]")))
    names = [name for name, _, _ in built]
    if len(set(names)) < len(names):
        raise ValueError(f"sum: parts {names} repeat a name; give repeated kinds a `name` each")

    def combine(rows: Sequence[Sequence[Any]]) -> Verdict:
        verdicts = [(name, weight, to_verdict(value)) for (name, weight, _), value in zip(built, rows)]
        failed = next((v.reason for _, _, v in verdicts if not v.passed), None)
        return Verdict(reward=sum(w * v.reward for _, w, v in verdicts), passed=failed is None,
                       reason=failed or "ok", parts=tuple((name, v.reward) for name, _, v in verdicts),
                       signs=tuple(sorted({sign for _, _, v in verdicts for sign in v.signs})))

    def score_batch(completions: Sequence[str], ground_truths: Sequence[str], prompts: Sequence[Prompt]) -> list:
        by_part = [score_rows(fn, completions, ground_truths, prompts) for _, _, fn in built]
        return [combine(row) for row in zip(*by_part)]
    return _batched_if_any(score_batch, [fn for _, _, fn in built])


def route_verifier(*, route: Mapping[str, Any]) -> RewardFn:
    """Each row to the verifier of its data_source. A data_source no route claims is refused at start-up
    (check_routes); a call that meets one anyway scores 0 with reason no_route."""
    if not route:
        raise ValueError("route: empty; map each data_source to a verifier, e.g. {gsm8k: math, ifeval: ifeval}")
    by_source = {source: build_verifier(spec, field=f"route.{source}") for source, spec in route.items()}

    def score_batch(completions: Sequence[str], ground_truths: Sequence[str], prompts: Sequence[Prompt]) -> list:
        results: list[Any] = [Verdict(reward=0.0, passed=False, reason=f"no_route: {p.data_source}") for p in prompts]
        for source, fn in by_source.items():
            rows = [i for i, p in enumerate(prompts) if p.data_source == source]
            if rows:
                values = score_rows(fn, [completions[i] for i in rows], [ground_truths[i] for i in rows],
                                    [prompts[i] for i in rows])
                for i, value in zip(rows, values):
                    results[i] = value
        return results
    return _batched_if_any(score_batch, list(by_source.values()))


def score_rows(fn: RewardFn, completions: Sequence[str], ground_truths: Sequence[str],
               prompts: Sequence[Prompt]) -> list[Any]:
    """fn's results for the rows: one score_batch call when fn is batchable, else one call per row."""
    if callable(getattr(fn, "score_batch", None)):
        values = list(fn.score_batch(completions, ground_truths, prompts))  # type: ignore[attr-defined]
        if len(values) != len(prompts):
            raise ValueError(f"score_batch returned {len(values)} results for {len(prompts)} rows; return one per row")
        return values
    return [fn(c, g, p) for c, g, p in zip(completions, ground_truths, prompts)]


def _batched_if_any(score_batch: Callable[..., list[Any]], fns: Sequence[RewardFn]) -> RewardFn:
    """A combinator of verifiers: batchable (at its largest part's batch_size) when one of them is, so a reward
    model or judge inside a sum or a route still scores a batch at once; else a plain one-row function."""
    sizes = [batch_size_of(fn) for fn in fns if callable(getattr(fn, "score_batch", None))]
    if sizes:
        return BatchedRewardFn(score_batch, max(sizes))

    def score(completion: str, ground_truth: str, prompt: Prompt) -> Any:
        return score_batch([completion], [ground_truth], [prompt])[0]
    return score


def check_rows(spec: VerifierSpec, prompts: Sequence[Prompt], *, field: str = "verifier") -> None:
    """Before any work: every row reaches a verifier (its data_source has a route), and its ground truth is one
    its verifier can read (a verifier module's check_ground_truth, e.g. ifeval's and code's), else a ValueError
    naming the field, the row and the fix."""
    options = dict(spec.options)
    if spec.kind == "route":
        check_routes(spec, sorted({p.data_source for p in prompts}), field=field)
        for source, sub in options["route"].items():
            check_rows(parse_spec(sub, field=f"{field}.route.{source}"), [p for p in prompts if p.data_source == source],
                       field=f"{field}.route.{source}")
        return
    if spec.kind == "sum":
        for index, part in enumerate(options["parts"]):
            part = {k: v for k, v in part.items() if k not in ("weight", "name")}
            check_rows(parse_spec(part, field=f"{field}.parts[{index}]"), prompts, field=f"{field}.parts[{index}]")
        return
    checker = getattr(importlib.import_module(FACTORIES[spec.kind].partition(":")[0]), "check_ground_truth", None)
    # A checker may take the spec's options that bear on it (code's unverified_asserts), by name.
    accepted = inspect.signature(checker).parameters if checker is not None else {}
    checked = {name: value for name, value in options.items() if name in accepted}
    for prompt in prompts if checker is not None else ():
        try:
            checker(prompt.ground_truth, **checked)
        except ValueError as error:
            raise ValueError(f"{field} ({spec.kind}): row {prompt.id}: {error}") from None


def check_routes(spec: VerifierSpec, data_sources: Sequence[str], *, field: str = "verifier") -> None:
    """Before any work: every data_source of a task's rows has a route (a spec that routes none passes)."""
    if spec.kind != "route":
        return
    routes = dict(spec.options)["route"]
    missing = sorted(set(data_sources) - set(routes))
    if missing:
        raise ValueError(f"{field}: rows with data_source {', '.join(map(repr, missing))} have no route; add them "
                         f"to route (routed now: {', '.join(sorted(routes))}; the registered verifiers: "
                         f"{', '.join(sorted(FACTORIES))})")
