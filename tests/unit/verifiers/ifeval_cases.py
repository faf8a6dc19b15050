"""Generated IFEval cases: for every instruction id, responses near its threshold (one under, at, one over a
count; present and absent; case variants; valid and broken JSON; ...), each also with a first line, a last line
and markdown stars added (what loose mode strips), and joined to one or two other instructions of the set, so a
case's reward is a fraction. Deterministic for a seed; used by test_ifeval_reference.py to hold the `ifeval`
verifier against IFEval's reference checker."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from flashreinforce.verifiers.ifeval import count_capital_words, count_sentences, count_words

WORDS = ("river", "garden", "window", "market", "pencil", "summer", "travel", "coffee", "planet", "silver", "rocket",
         "mountain", "bridge", "letter", "forest", "orange", "winter", "signal", "harbor", "candle", "jacket",
         "ladder", "museum", "pepper", "tunnel", "basket", "meadow", "violin", "anchor", "blanket")
SENTENCES = (
    "The cat sat on the mat.", "Dr. Smith visited the clinic on Monday.", "We met at 5 p.m. and talked for hours.",
    "Is this the right answer?", "What a surprise!", "Wow!!! That was fast.", 'She said "Hello." Then she left.',
    "Prices rose by 3.5 percent in 2020.", "Fruits, e.g. apples, are healthy.", "It was late... we went home.",
    "The U.S. economy grew last year.", "(This is an aside.)", "**This matters a lot.**", "Really?! No way.",
    "Mr. Jones arrived at 9 a.m. The meeting began.", "The results were clear, etc. and more came.",
    "I. Introduction to the plan", "Point A. Point B.", "P.S. See you soon.", "Washington D.C. is the capital.",
    "He asked, \"Why not?\" and smiled.", "J. K. Rowling wrote seven books.", "It cost $3.50. That was cheap.",
    "Version 2.0 came out in 2021. it was slow.", "We saw it in 2019. Then it vanished.")
LANGUAGE_TEXTS = {
    "en": "The weather is lovely today and we are going to the park with our friends.",
    "fr": "Le temps est magnifique aujourd'hui et nous allons au parc avec nos amis.",
    "de": "Das Wetter ist heute wunderschön und wir gehen mit unseren Freunden in den Park.",
    "es": "El tiempo está precioso hoy y vamos al parque con nuestros amigos.",
    "it": "Oggi il tempo è bellissimo e andiamo al parco con i nostri amici.",
    "pt": "O tempo está lindo hoje e vamos ao parque com os nossos amigos.",
    "ru": "Сегодня прекрасная погода, и мы идём в парк с друзьями.",
    "hi": "आज मौसम बहुत अच्छा है और हम अपने दोस्तों के साथ पार्क जा रहे हैं।",
    "ar": "الطقس جميل اليوم ونحن ذاهبون إلى الحديقة مع أصدقائنا.",
    "ko": "오늘은 날씨가 정말 좋아서 친구들과 함께 공원에 갑니다.",
    "fi": "Tänään on kaunis sää ja menemme puistoon ystäviemme kanssa.",
    "sw": "Leo hali ya hewa ni nzuri na tunaenda bustanini pamoja na marafiki zetu.",
    "vi": "Hôm nay thời tiết rất đẹp và chúng tôi đi công viên với bạn bè.",
}
CAPITAL_ITEMS = ("HELLO", "DON'T", "AT&T", "CANNOT", "U.S.", "I", "COVID-19", "Q&A", "NASA's", "IT'S", "O'NEIL",
                 "ROCK-SOLID", "A,B", "(USA)", "OK?", "wanna", "GONNA", "I'M", "WE'LL", "hello", "Mixed", "R&D",
                 "x", "THEY'RE", "NO:", "YES!", "I/O", "\u201cQUOTED\u201d", "IT\u2019S")
LANGUAGE_IDS = ("language:response_language", "change_case:english_capital", "change_case:english_lowercase")
PROMPTS = ("Write a short poem about the sea.", "Describe your favourite city in two sentences.",
           "List three reasons to learn Python.")


@dataclass(frozen=True)
class Case:
    instruction_id_list: tuple[str, ...]
    kwargs: tuple[dict[str, Any], ...]
    response: str
    prompt: str = PROMPTS[0]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _around(count: int) -> tuple[int, ...]:
    # No threshold of 0: IFEval's data has none, and lm-eval's wrapper drops a kwarg of 0 (it keeps truthy values
    # only), so its checker would draw a random threshold instead (test_ifeval.py pins 0 on our side).
    return tuple(n for n in (count - 1, count, count + 1) if n >= 1)


def _relations(count: int, name: str, relation: str) -> Iterator[dict[str, Any]]:
    for threshold in _around(count):
        for rel in ("less than", "at least"):
            yield {name: threshold, relation: rel}


def _keywords(rng: random.Random) -> Iterator[tuple[dict, str]]:
    words = rng.sample(WORDS, 3)
    yield {"keywords": words[:2]}, f"{_text(rng, 5)} {words[0]} and {words[1].upper()}."
    yield {"keywords": words[:2]}, f"{_text(rng, 5)} {words[0]} only."
    yield {"keywords": [words[2]]}, f"{words[2]}s are {words[2].capitalize()}-like."
    yield {"keywords": ["zebra"]}, _text(rng, 8)


def _frequency(rng: random.Random) -> Iterator[tuple[dict, str]]:
    word = rng.choice(WORDS)
    for n in range(4):
        response = " ".join([_text(rng, 3)] + [rng.choice((word, word.upper(), word + "s")) for _ in range(n)])
        for kwargs in _relations(n, "frequency", "relation"):
            yield {"keyword": word, **kwargs}, response


def _forbidden(rng: random.Random) -> Iterator[tuple[dict, str]]:
    word = rng.choice(WORDS)
    yield {"forbidden_words": [word, "zebra"]}, f"{_text(rng, 4)} {word.capitalize()} here."
    yield {"forbidden_words": [word]}, f"{_text(rng, 4)} {word}s and {word}-like things."
    yield {"forbidden_words": [word]}, _text(rng, 6).replace(word, "")


def _letters(rng: random.Random) -> Iterator[tuple[dict, str]]:
    letter = rng.choice("aeioustnrq")
    response = _text(rng, 6) + " " + letter.upper() * rng.randint(0, 3)
    count = response.lower().count(letter)
    for kwargs in _relations(count, "let_frequency", "let_relation"):
        yield {"letter": letter, **kwargs}, response


def _language(rng: random.Random) -> Iterator[tuple[dict, str]]:
    for code, text in LANGUAGE_TEXTS.items():
        yield {"language": code}, text
        yield {"language": rng.choice([c for c in LANGUAGE_TEXTS if c != code])}, text
    yield {"language": "de"}, "12345 67890 !!!"
    yield {"language": "en"}, LANGUAGE_TEXTS["en"] + " " + LANGUAGE_TEXTS["fr"]


def _sentences(rng: random.Random) -> Iterator[tuple[dict, str]]:
    for _ in range(6):
        chosen = rng.sample(SENTENCES, rng.randint(1, 6))
        response = "".join(s + rng.choice((" ", "\n", "\n\n")) for s in chosen).strip()
        for kwargs in _relations(count_sentences(response), "num_sentences", "relation"):
            yield kwargs, response


def _words(rng: random.Random) -> Iterator[tuple[dict, str]]:
    response = _text(rng, rng.randint(5, 12)) + " don't 3.5 e-mail."
    for kwargs in _relations(count_words(response), "num_words", "relation"):
        yield kwargs, response


def _paragraphs(rng: random.Random) -> Iterator[tuple[dict, str]]:
    parts = [_text(rng, 4) for _ in range(rng.randint(1, 4))]
    for joined in ("\n\n***\n\n".join(parts), " *** ".join(parts), "***\n" + "\n***\n".join(parts) + "\n***",
                   "\n\n***\n\n***\n\n".join(parts), "****".join(parts)):
        for n in _around(len(parts)):
            yield {"num_paragraphs": n}, joined


def _first_word(rng: random.Random) -> Iterator[tuple[dict, str]]:
    word = rng.choice(WORDS)
    first = [word, word.upper(), f'"{word.capitalize()},', f"'{word}!", "other"]
    for lead in first:
        paragraphs = [_text(rng, 4), f"{lead} {_text(rng, 3)}", _text(rng, 3)]
        for glue in ("\n\n", "\n\n\n\n", "\n"):
            for n in (2, 3):
                yield {"num_paragraphs": n, "nth_paragraph": 2, "first_word": word}, glue.join(paragraphs)


def _placeholders(rng: random.Random) -> Iterator[tuple[dict, str]]:
    for n in range(4):
        response = " ".join(f"[{rng.choice(WORDS)}]" for _ in range(n)) + " [broken\nbracket]"
        for threshold in _around(n):
            yield {"num_placeholders": threshold}, response


def _postscript(rng: random.Random) -> Iterator[tuple[dict, str]]:
    body = _text(rng, 6)
    for marker in ("P.S.", "P.P.S", "Note:"):
        for tail in ("P.S. see you", "p. s. later", "P.P.S more", "p.p.s. last", "PS nothing", "note: this"):
            yield {"postscript_marker": marker}, f"{body}\n\n{tail}"


def _bullets(rng: random.Random) -> Iterator[tuple[dict, str]]:
    n = rng.randint(1, 4)
    lines = [rng.choice(("* ", "- ", "  * ", "*")) + _text(rng, 2) for _ in range(n)]
    for extra in ("", "\n**Bold line**", "\n---", "\n-5 degrees"):
        response = _text(rng, 3) + "\n" + "\n".join(lines) + extra
        for threshold in _around(n):
            yield {"num_bullets": threshold}, response


def _constrained(rng: random.Random) -> Iterator[tuple[dict, str]]:
    for answer in ("My answer is yes.", "My answer is maybe.", "My answer is Yes.", "my answer is no.", "No."):
        yield {}, f"{_text(rng, 3)} {answer}"


def _highlights(rng: random.Random) -> Iterator[tuple[dict, str]]:
    spans = [rng.choice(("*{}*", "**{}**", "* *", "**", "*{}\nx*")).format(rng.choice(WORDS)) for _ in range(4)]
    response = " ".join(spans)
    for threshold in range(1, 6):
        yield {"num_highlights": threshold}, response


def _sections(rng: random.Random) -> Iterator[tuple[dict, str]]:
    for marker in ("Section", "SECTION", "Day"):
        n = rng.randint(1, 3)
        for cases in ((marker,), (marker, marker.lower())):  # the marker's case as given, or now and then not
            response = "\n".join(f"{rng.choice(cases)} {i + 1}\n{_text(rng, 3)}" for i in range(n))
            for threshold in _around(n):
                yield {"section_spliter": marker, "num_sections": threshold}, response + f"\n{marker} X"


def _json(rng: random.Random) -> Iterator[tuple[dict, str]]:
    word = rng.choice(WORDS)
    for text in (f'{{"a": "{word}"}}', '```json\n{"a": 1}\n```', "```\n[1, 2]\n```", f'{{"a": {word}}}',
                 'Here: {"a": 1}', "```JSON\n3\n```", '{"a": 1}\n```'):
        yield {}, text


def _title(rng: random.Random) -> Iterator[tuple[dict, str]]:
    for title in ("<<A Title>>", "<< >>", "<<>>", "<<broken\ntitle>>", "<<one>> and <<two>>"):
        yield {}, f"{title}\n{_text(rng, 5)}"


def _two(rng: random.Random) -> Iterator[tuple[dict, str]]:
    a, b = _text(rng, 4), _text(rng, 4)
    for text in (f"{a}\n******\n{b}", f"{a}\n******\n{a}", f"{a}******{b}******{a}", f"{a}\n******\n\n******\n{b}",
                 f"******\n{a}\n******\n{b}\n******", a):
        yield {}, text


def _repeat(rng: random.Random) -> Iterator[tuple[dict, str]]:
    prompt = rng.choice(PROMPTS)
    for text in (f"{prompt} {_text(rng, 4)}", f"  {prompt.upper()}\n{_text(rng, 4)}", f"Sure! {prompt}", prompt[:-1]):
        yield {"prompt_to_repeat": prompt}, text


def _end(rng: random.Random) -> Iterator[tuple[dict, str]]:
    phrase = "Is there anything else I can help with?"
    body = _text(rng, 5)
    for text in (f"{body} {phrase}", f'"{body} {phrase.lower()}"', f"{body} {phrase} Bye.", f"{body} {phrase}\n\n"):
        yield {"end_phrase": phrase}, text


def _capitals(rng: random.Random) -> Iterator[tuple[dict, str]]:
    for _ in range(4):
        response = " ".join(rng.choice(CAPITAL_ITEMS) for _ in range(rng.randint(2, 8))) + "."
        for kwargs in _relations(count_capital_words(response), "capital_frequency", "capital_relation"):
            yield kwargs, response


def _english_case(rng: random.Random) -> Iterator[tuple[dict, str]]:
    for text in (LANGUAGE_TEXTS["en"], LANGUAGE_TEXTS["fr"], LANGUAGE_TEXTS["de"], "12345 !!!", "the END"):
        yield {}, text.upper()
        yield {}, text.lower()
        yield {}, text


def _no_comma(rng: random.Random) -> Iterator[tuple[dict, str]]:
    yield {}, _text(rng, 5)
    yield {}, _text(rng, 3) + ", " + _text(rng, 2)


def _quotation(rng: random.Random) -> Iterator[tuple[dict, str]]:
    body = _text(rng, 4)
    for text in (f'"{body}"', f'  "{body}"\n', f'"{body}', '"', f"'{body}'", '""'):
        yield {}, text


BUILDERS: dict[str, Callable[[random.Random], Iterator[tuple[dict, str]]]] = {
    "keywords:existence": _keywords, "keywords:frequency": _frequency, "keywords:forbidden_words": _forbidden,
    "keywords:letter_frequency": _letters, "language:response_language": _language,
    "length_constraints:number_sentences": _sentences, "length_constraints:number_paragraphs": _paragraphs,
    "length_constraints:number_words": _words, "length_constraints:nth_paragraph_first_word": _first_word,
    "detectable_content:number_placeholders": _placeholders, "detectable_content:postscript": _postscript,
    "detectable_format:number_bullet_lists": _bullets, "detectable_format:constrained_response": _constrained,
    "detectable_format:number_highlighted_sections": _highlights, "detectable_format:multiple_sections": _sections,
    "detectable_format:json_format": _json, "detectable_format:title": _title, "combination:two_responses": _two,
    "combination:repeat_prompt": _repeat, "startend:end_checker": _end,
    "change_case:capital_word_frequency": _capitals, "change_case:english_capital": _english_case,
    "change_case:english_lowercase": _english_case, "punctuation:no_comma": _no_comma,
    "startend:quotation": _quotation,
}


def _loose_forms(rng: random.Random, response: str) -> tuple[str, ...]:
    """The response, and with what loose mode removes: a first line, a last line, markdown stars."""
    return (response, f"Sure, here it is:\n{response}", f"{response}\nHope this helps!",
            f"**Answer**\n{response}\n*done*", response.replace(" ", " *", 1))


def generate(seed: int = 0) -> list[Case]:
    """Every builder's responses in each loose form, alone and joined with 1-2 instructions from other builders."""
    rng = random.Random(seed)
    pool = [(instruction_id, kwargs, response) for instruction_id, build in BUILDERS.items()
            for kwargs, response in build(rng)]
    # langdetect takes ~15 ms a call: the language ids are joined to no other case, and take two forms only.
    others_pool = [case for case in pool if case[0] not in LANGUAGE_IDS]
    cases = []
    for instruction_id, kwargs, response in pool:
        forms = _loose_forms(rng, response)
        for form in forms[:2] if instruction_id in LANGUAGE_IDS else forms:
            cases.append(Case((instruction_id,), (kwargs,), form))
            others = rng.sample(others_pool, rng.randint(1, 2))
            cases.append(Case((instruction_id, *(o[0] for o in others)), (kwargs, *(o[1] for o in others)), form,
                              prompt=rng.choice(PROMPTS)))
    return cases
