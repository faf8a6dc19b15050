"""The instruction-following task: short requests with 1-3 IFEval constraints, small enough for the tiny model.

A prompt asks for a few words of a topic, then states its constraints, and ends with a newline; the answer we
teach lists the words and meets every constraint:

    Name 2 colors. Say red at least 2 times. No commas.\\n  ->  blue red red.
    Name 3 animals. Do not say cat. Add a P.S. End with bye.\\n  ->  owl, dog, yak. p.s. ok. bye

The constraints are real IFEval instruction ids with IFEval's kwargs, and a prompt's ground truth is the JSON
that the `ifeval` verifier reads, `{"instruction_id_list": [...], "kwargs": [...]}` (only the constraints are
scored: IFEval does not check that the words are colors). `Prompt.difficulty` is the number of constraints.

The ids are the ones a character-level model can meet by what it writes: the words it picks, their case,
separators, a postscript, an ending, a length. Not `change_case:english_lowercase` / `english_capital`: they also
ask langdetect whether the answer is English, and on lists this short it mostly says no ("pig, hen, dog" reads
as Dutch: 74% of such lists are not English to it), so a perfect answer would fail;
`change_case:capital_word_frequency` asks for capitals without it.

Warm-start demonstrations (`demonstration`) violate each constraint with a given probability, doing what they
would do without it (lowercase instead of capitals, the forbidden word named, commas kept, the P.S. or the
ending left out, too many words), so a model trained on them follows each constraint only part of the time and
RL has something to fix. Everything comes from a seed and the standard library.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flashreinforce.types import Prompt

DATA_SOURCE = "instructions"
ALPHABET = string.ascii_letters + string.digits + " .,\n"
"""Every character a prompt or an answer uses (a tokenizer adds its own EOS / pad)."""
TOPICS: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "animals": ("animal", ("cat", "dog", "cow", "pig", "fox", "owl", "bee", "yak")),
    "colors": ("color", ("red", "blue", "green", "pink", "gray", "gold", "black", "white")),
    "fruits": ("fruit", ("apple", "pear", "plum", "lime", "fig", "kiwi", "grape", "melon")),
    "tools": ("tool", ("saw", "axe", "drill", "hammer", "wrench", "rake", "hoe", "chisel")),
}
"""Plural -> (singular, its words). No word is part of another word an answer can hold (IFEval counts a keyword
inside other words too), which tests/unit/data/test_instructions.py checks."""
END_PHRASES = ("bye", "the end", "thanks")
POSTSCRIPT = "p.s. ok."
CAPITALS, EXISTENCE, FREQUENCY, FORBIDDEN = ("change_case:capital_word_frequency", "keywords:existence",
                                             "keywords:frequency", "keywords:forbidden_words")
END, NO_COMMA, PS, WORDS = ("startend:end_checker", "punctuation:no_comma", "detectable_content:postscript",
                            "length_constraints:number_words")
CONSTRAINTS = (CAPITALS, EXISTENCE, FREQUENCY, FORBIDDEN, END, NO_COMMA, PS, WORDS)
"""The IFEval instruction ids this task draws its constraints from."""
MAX_WORDS = 3
"""Most words a prompt asks for."""
_KEYWORD_KINDS = (EXISTENCE, FREQUENCY, FORBIDDEN)
_REQUEST = re.compile(r"Name (\d+) (\w+)\.")
# A held-out split takes distinct prompts; this many failed draws in a row means the settings have too few.
_MAX_REJECTIONS = 10_000


@dataclass(frozen=True)
class Constraint:
    id: str
    """The IFEval instruction id."""
    kwargs: Mapping[str, Any]
    """Its IFEval kwargs."""


@dataclass(frozen=True)
class Request:
    """What a prompt asks: `count` words of `topic` (a key of TOPICS), meeting `constraints` in order."""

    topic: str
    count: int
    constraints: tuple[Constraint, ...]


def check_constraints(constraints: Sequence[str], constraint_weights: Sequence[float]) -> None:
    """ValueError naming the data.instructions field and the fix, None when a split can be drawn."""
    unknown = [c for c in constraints if c not in CONSTRAINTS]
    if unknown or not constraints:
        raise ValueError(f"data.instructions.constraints={list(constraints)}: choose a non-empty subset of "
                         f"{', '.join(CONSTRAINTS)}" + (f" ({', '.join(unknown)} is not one)" if unknown else ""))
    weights = [float(w) for w in constraint_weights]
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"data.instructions.constraint_weights={list(constraint_weights)}: give the shares of "
                         "prompts with 1, 2 (and 3) constraints, non-negative with a positive sum, e.g. [1, 1, 1]")
    if len(weights) > len(constraints) and any(weights[len(constraints):]):
        raise ValueError(f"data.instructions.constraint_weights={weights} asks for {len(weights)} constraints in a "
                         f"prompt but constraints lists {len(constraints)}: add ids or give those counts weight 0")


# ---- drawing a request ------------------------------------------------------------------------------------

def _keyword(rng: random.Random, words: tuple[str, ...], taken: set[str]) -> str:
    word = rng.choice([w for w in words if w not in taken])
    taken.add(word)
    return word


def _draw_constraint(kind: str, rng: random.Random, words: tuple[str, ...], taken: set[str]) -> Constraint:
    """One constraint of `kind` with its kwargs (a number of words is set later, once the answer is known)."""
    if kind == CAPITALS:
        return Constraint(kind, {"capital_frequency": 1, "capital_relation": "at least"})  # raised in _request
    if kind == EXISTENCE:
        return Constraint(kind, {"keywords": [_keyword(rng, words, taken)]})
    if kind == FREQUENCY:
        return Constraint(kind, {"keyword": _keyword(rng, words, taken), "frequency": rng.randint(2, 3),
                                 "relation": "at least"})
    if kind == FORBIDDEN:
        return Constraint(kind, {"forbidden_words": [_keyword(rng, words, taken)]})
    if kind == END:
        return Constraint(kind, {"end_phrase": rng.choice(END_PHRASES)})
    if kind == PS:
        return Constraint(kind, {"postscript_marker": "P.S."})
    if kind == WORDS:
        return Constraint(kind, {"num_words": 0, "relation": "less than"})  # set in _request
    return Constraint(kind, {})  # no_comma


def _request(rng: random.Random, constraints: Sequence[str], weights: Sequence[float]) -> Request:
    topic = rng.choice(sorted(TOPICS))
    words = TOPICS[topic][1]
    size = rng.choices(range(1, len(weights) + 1), weights=weights)[0]
    taken: set[str] = set()
    drawn = [_draw_constraint(kind, rng, words, taken) for kind in rng.sample(list(constraints), size)]
    # Room for every keyword, the forbidden one too: a demonstration that names it does so instead of another
    # word, so its other constraints still hold. Without commas, two words at least: one word has none to drop.
    least = max(1 + any(c.id == NO_COMMA for c in drawn), sum(c.id in _KEYWORD_KINDS for c in drawn))
    count = rng.randint(least, MAX_WORDS)
    request = Request(topic, count, tuple(drawn))
    # A length limit a little above the clean answer's length (the answer's words do not depend on the draw).
    clean_words = count_words(render_answer(request, random.Random(0)))
    settled = []
    for c in drawn:
        if c.id == CAPITALS:
            c = Constraint(c.id, {**c.kwargs, "capital_frequency": rng.randint(1, count)})
        elif c.id == WORDS:
            c = Constraint(c.id, {**c.kwargs, "num_words": clean_words + rng.randint(1, 2)})
        settled.append(c)
    return Request(topic, count, tuple(settled))


def prompt_text(request: Request) -> str:
    """`Name 2 colors. Say red at least 2 times. No commas.` and a newline, the cue to answer."""
    singular, _ = TOPICS[request.topic]
    noun = singular if request.count == 1 else request.topic
    return " ".join([f"Name {request.count} {noun}.", *map(_sentence, request.constraints)]) + "\n"


def _sentence(constraint: Constraint) -> str:
    args = constraint.kwargs
    capitals = args.get("capital_frequency", 0)
    return {
        CAPITALS: lambda: f"Use at least {capitals} capital word{'s' * (capitals > 1)}.",
        EXISTENCE: lambda: f"Include {args['keywords'][0]}.",
        FREQUENCY: lambda: f"Say {args['keyword']} at least {args['frequency']} times.",
        FORBIDDEN: lambda: f"Do not say {args['forbidden_words'][0]}.",
        END: lambda: f"End with {args['end_phrase']}.",
        NO_COMMA: lambda: "No commas.",
        PS: lambda: "Add a P.S.",
        WORDS: lambda: f"Use less than {args['num_words']} words.",
    }[constraint.id]()


def ground_truth(request: Request) -> str:
    """The IFEval JSON of the request's constraints, as the `ifeval` verifier reads it."""
    return json.dumps({"instruction_id_list": [c.id for c in request.constraints],
                       "kwargs": [dict(c.kwargs) for c in request.constraints]})


def make_instructions_splits(
    num_train: int,
    num_eval: int,
    *,
    seed: int,
    constraints: Sequence[str] = CONSTRAINTS,
    constraint_weights: Sequence[float] = (1.0, 1.0, 1.0),
    chat: bool = False,
) -> tuple[list[Prompt], list[Prompt]]:
    """Train and held-out prompts, deterministic from `seed`: held-out prompts are distinct, and no training prompt
    has a held-out prompt's text (training prompts may repeat among themselves). Ids: "instructions/train/000042".
    `chat`: each prompt is one user message (its text without the newline), for a chat model's template."""
    if num_train < 0 or num_eval < 0:
        raise ValueError(f"data.instructions: num_train={num_train}, num_eval={num_eval}; use counts >= 0")
    check_constraints(constraints, constraint_weights)
    rng, held_out = random.Random(seed), set()

    def sample(split: str, n: int, distinct: bool) -> list[Prompt]:
        items = []
        for i in range(n):
            for _ in range(_MAX_REJECTIONS):
                request = _request(rng, constraints, constraint_weights)
                if prompt_text(request) not in held_out:
                    break
            else:
                raise ValueError(f"data.instructions: no {split} prompt left outside the held-out split; lower "
                                 f"num_eval ({num_eval}) or allow more constraints")
            if distinct:
                held_out.add(prompt_text(request))
            text = prompt_text(request)
            items.append(Prompt(id=f"{DATA_SOURCE}/{split}/{i:06d}",
                                prompt=({"role": "user", "content": text.rstrip()},) if chat else text,
                                ground_truth=ground_truth(request), data_source=DATA_SOURCE,
                                difficulty=float(len(request.constraints))))
        return items

    # Held-out first, so the training draws can avoid its prompts.
    eval_items = sample("eval", num_eval, distinct=True)
    return sample("train", num_train, distinct=False), eval_items


# ---- answers ------------------------------------------------------------------------------------------------

def request_of(item: Prompt) -> Request:
    """The request a prompt of this task states (from its text and its ground truth)."""
    text = item.prompt if isinstance(item.prompt, str) else item.prompt[-1]["content"]
    match = _REQUEST.match(text)
    topic = next((plural for plural, (singular, _) in TOPICS.items() if match and match[2] in (plural, singular)),
                 None)
    if match is None or topic is None:
        raise ValueError(f"prompt {item.id} is {text!r}, not an instructions prompt like 'Name 2 colors. ...'")
    record = json.loads(item.ground_truth)
    constraints = tuple(Constraint(i, kwargs) for i, kwargs in zip(record["instruction_id_list"], record["kwargs"]))
    return Request(topic, int(match[1]), constraints)


def count_words(text: str) -> int:
    """Runs of letters and digits, as IFEval counts words in these answers ("p.s." is two)."""
    return len(re.findall(r"[A-Za-z0-9]+", text))


def render_answer(request: Request, rng: random.Random, violated: Sequence[bool] = ()) -> str:
    """An answer to the request: `count` of the topic's words, drawn with `rng`, meeting every constraint except
    those with violated[i] true, which it treats as the default answer would (see the module docstring)."""
    kept = {c.id: c.kwargs for c, bad in zip(request.constraints, [*violated, *[False] * len(request.constraints)])
            if not bad}
    broken = {c.id: c.kwargs for c in request.constraints if c.id not in kept}
    items = _items(request, rng, kept, broken)
    tail = (f" {POSTSCRIPT}" if PS in kept else "") + (f" {kept[END]['end_phrase']}" if END in kept else "")
    separator = " " if NO_COMMA in kept else ", "
    answer = separator.join(items) + "." + tail
    if WORDS in broken:  # too many words: more of the topic's, other than the keywords, until the limit is reached
        spare = [w for w in TOPICS[request.topic][1] if w not in _keywords(request)]
        while count_words(answer) < broken[WORDS]["num_words"]:
            items.append(rng.choice(spare))
            answer = separator.join(items) + "." + tail
    return answer.upper() if CAPITALS in kept else answer


def _keywords(request: Request) -> set[str]:
    words = set()
    for c in request.constraints:
        words.update(c.kwargs.get("keywords", ()), c.kwargs.get("forbidden_words", ()))
        words.update([c.kwargs["keyword"]] if "keyword" in c.kwargs else [])
    return words


def _items(request: Request, rng: random.Random, kept: Mapping[str, Any], broken: Mapping[str, Any]) -> list[str]:
    """The listed words: the required keywords (a violated frequency still once) and others of the topic, never a
    kept forbidden word nor a violated existence keyword; a kept frequency's extra mentions at the end."""
    required = [*kept.get(EXISTENCE, {}).get("keywords", ()), *broken.get(FORBIDDEN, {}).get("forbidden_words", ())]
    frequency = kept.get(FREQUENCY) or broken.get(FREQUENCY)
    if frequency:
        required.append(frequency["keyword"])
    excluded = _keywords(request) - set(required)
    others = [w for w in TOPICS[request.topic][1] if w not in excluded and w not in required]
    items = [*required, *rng.sample(others, max(0, request.count - len(required)))]
    rng.shuffle(items)
    if FREQUENCY in kept:
        items += [kept[FREQUENCY]["keyword"]] * (kept[FREQUENCY]["frequency"] - 1)
    return items


def demonstration(item: Prompt, rng: random.Random, violation_rate: float) -> str:
    """A warm-start answer to the prompt: each constraint violated with probability violation_rate."""
    if not 0.0 <= violation_rate <= 1.0:
        raise ValueError(f"data.instructions.violation_rate={violation_rate} is a probability: use a value in [0, 1]")
    request = request_of(item)
    # One draw per constraint whatever the rate, so a seed's answers differ only where the violations do.
    violated = [rng.random() < violation_rate for _ in request.constraints]
    return render_answer(request, rng, violated)
