"""The registry's `ifeval`: the 25 instruction-following constraints of Google's IFEval set, checked offline.

A row's ground truth is the IFEval record's two fields as JSON, `{"instruction_id_list": [...], "kwargs":
[...]}`, one kwargs object per id. A kwarg whose value is null is not given (Hugging Face's copy of the data
gives every row every kwarg, null where it does not apply). The reward is the fraction of constraints met, or
1/0 for all met (option `all`); the Verdict passes when all are met and its reason names the first one that
failed ("failed: length_constraints:number_words"). Only the answer counts: what follows the last `</think>`
(without the whitespace that separates it from the think), nothing (no_answer) when a `<think>` never closes.

Each constraint means what IFEval's checker means by it, so a reward here is the score IFEval would give;
tests/unit/verifiers/test_ifeval_reference.py holds the two side by side on generated responses. The places
where the meaning needs a rule of its own, none of which downloads anything:

- Words (`length_constraints:number_words`): runs of word characters, so "don't" is two words and "3.5" is
  two; a letter's combining marks are part of its word (IFEval's count, see count_words).
- Sentences (`length_constraints:number_sentences`): IFEval counts with NLTK's Punkt model for English, a
  data file that NLTK downloads; count_sentences is our own rule set, written to end sentences where Punkt
  does (see its docstring: e.g. "e.g." ends a sentence there, "Dr. Smith" does not). It agrees with Punkt on
  the generated responses of the reference test; on free text it can differ around abbreviations.
- Capital words (`change_case:capital_word_frequency`): IFEval tokenizes with NLTK's word_tokenize, which
  splits contractions ("DON'T" is DO + N'T, two capital words) and some punctuation ("AT&T" is two);
  count_capital_words splits where it does (its docstring lists where).
- Language (`language:response_language`, and the English test of `change_case:english_capital` and
  `change_case:english_lowercase`): langdetect, the detector IFEval itself uses, with its bundled profiles and a
  fixed seed, so the same text always gets the same verdict. It comes with the `ifeval` extra (`pip install -e
  '.[ifeval]'`); a row that needs it without the extra is an error naming the extra. A text in which langdetect
  finds no letters (digits, punctuation) counts as met, as in IFEval.

Where IFEval's checker leaves the data's meaning, we keep the meaning: keywords, section markers and
postscript markers are literal text (IFEval compiles them as regular expressions); a `letter` that is not a
letter ("#", "!": two rows of the data) is counted as given (IFEval replaces it with a random letter); a kwarg
IFEval would invent at random when missing is an error here; `language: "zh"` accepts either Chinese profile
(langdetect names them zh-cn and zh-tw, so IFEval never passes "zh").

Strict mode (default) checks the answer as it is. Loose mode (`strict: false`, IFEval's "loose" accuracy) also
accepts a constraint when it holds on the answer with its first line, its last line or both removed, and on
each of those four with every `*` removed. An empty answer meets nothing in either mode.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import json
import re
import sys
import types
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flashreinforce.data.arithmetic import THINK_CLOSE
from flashreinforce.types import NO_ANSWER, Prompt, Verdict
from flashreinforce.verifiers.text import final_part

RELATIONS = ("less than", "at least")
EXTRA = "pip install -e '.[ifeval]'"
LANGDETECT_CODES = (
    "af", "ar", "bg", "bn", "ca", "cs", "cy", "da", "de", "el", "en", "es", "et", "fa", "fi", "fr", "gu", "he",
    "hi", "hr", "hu", "id", "it", "ja", "kn", "ko", "lt", "lv", "mk", "ml", "mr", "ne", "nl", "no", "pa", "pl",
    "pt", "ro", "ru", "sk", "sl", "so", "sq", "sv", "sw", "ta", "te", "th", "tl", "tr", "uk", "ur", "vi", "zh-cn",
    "zh-tw")
"""The languages langdetect 1.0.9 has profiles for (ISO 639-1, Chinese split in two)."""
LANGUAGES = (*LANGDETECT_CODES, "zh")


# ---- words and sentences ------------------------------------------------------------------------------------

def count_words(text: str) -> int:
    """Runs of word characters: "It's 3.5 km." has 5 (It, s, 3, 5, km).

    A word character is a letter, a digit, `_`, or a mark that combines with a letter (so "मौसम", with its
    vowel signs, is one word, not three): Unicode's word characters, which IFEval's tokenizer (NLTK's, over
    the `regex` engine) counts with. Python's own `\\w` lacks the marks."""
    return len(_word_pattern().findall(text))


@functools.lru_cache(maxsize=1)
def _word_pattern() -> re.Pattern[str]:
    """\\w without numeric symbols ("½", "²"), with combining marks, connectors and joiners; built once."""
    def is_word(char: str) -> bool:
        category = unicodedata.category(char)
        return (category != "No" and char.isalnum()) or category[0] == "M" or category == "Pc" or char in "\u200c\u200d"
    ranges: list[list[int]] = []
    for code in range(sys.maxunicode + 1):
        if is_word(chr(code)):
            if ranges and ranges[-1][1] == code - 1:
                ranges[-1][1] = code
            else:
                ranges.append([code, code])
    spans = "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)
    return re.compile(f"[{spans}]+")


# A sentence may end at a mark followed by a space and a word, or by one of these (a quote, a bracket, `*`).
_AFTER_MARK = "()\"';}\\]*:@{\\[\u2018\u2019\u201c\u201d\xab\xbb?!"
_MARK = re.compile(rf"[.?!](?=(?P<punct>[{_AFTER_MARK}])|\s+(?P<next>\S+))")
_NOT_WORD = re.compile(rf"[{_AFTER_MARK}]")
_AT_NOT_WORD = re.compile(rf"(?=[{_AFTER_MARK}])")
_NO_WORD_START = "(\"`{[:;&#*@)}]-,"
_NUMBER = re.compile(r"-?[.,]?\d[\d,.\-]*")
_INITIAL = re.compile(r"[^\W\d_]\.")  # "K." in "J. K. Rowling"
_DOTTED = re.compile(r"[^\W\d_](?:\.[^\W\d_])+")  # "U.S", "J.K", "D.C" (their final period is the mark)
# Closing quotes and brackets right after a sentence's end belong to it ('He left." Then', '(see above.) Now').
_CLOSING = re.compile(r"[\"')\]}\u2018\u2019\u201c\u201d\xab\xbb]+(?:\s+|(?=--)|$)", re.MULTILINE)
# Abbreviations after which a period does not end the sentence (unless a sentence word follows). Not "e.g.",
# "i.e.", "etc." nor "P.S.": IFEval's Punkt model ends a sentence after those, and so do we.
_ABBREVIATIONS = frozenset("""
    mr mrs ms dr prof st jr sr rep reps sen gen col lt maj adm gov messrs inc ltd co corp cos bros vs v ave ft
    yr jan feb aug sep sept oct nov dec wed fri tues calif fla mich minn conn
""".split())
_NOT_ABBREVIATIONS = frozenset({"e.g", "i.e", "p.s", "p.p.s"})
# Single letters that Punkt's English model knows as abbreviations ("c. 1900", "p. 12"): never a sentence's end.
_LETTER_ABBREVIATIONS = frozenset("cdefghklmnprstvw")
# Capitalized, these begin a sentence after an abbreviation or an ellipsis ("at 5 p.m. The talk began": two
# sentences); other capitalized words ("Dr. Smith", "5 p.m. We") do not.
_STARTERS = frozenset("""
    the this these there thus therefore however but so yet in if when while since although though even it he
    they i your her some many most both finally here which please note overall instead moreover furthermore
    meanwhile still indeed nevertheless similarly sometimes such
""".split())


def count_sentences(text: str) -> int:
    """Sentences, ended by rules that follow IFEval's Punkt model for English on ordinary prose.

    A sentence may end at `?`, `!` or `.` followed by a space and a word, or by a quote, a bracket or `*`
    (where several marks touch, "!!!" or '?!"', the last one decides). `?` and `!` always end it: "Hi! ok." is
    two sentences, and so is 'He said "Hi." Then left.' A line break alone ends nothing ("* item one\\n* item
    two" is one sentence). A period ends it, except:
      - after an abbreviation (_ABBREVIATIONS, or letters with periods: "Dr.", "U.S.", "J.K.") or an ellipsis
        ("..."): only when a capitalized sentence word (_STARTERS: "The", "However", ...) follows;
      - after a single letter: never for c, d, e, f, g, h, k, l, m, n, p, r, s, t, v, w ("c. 1900", "John
        F. Kennedy"); for the others (an outline's "I." and "A.", "Plan B.") unless a lowercase word, a lone
        mark or another initial follows ("J. K. Rowling"); Punkt also keeps names it knows after "J." and
        some words it never saw ("A. Overview"), which these rules cannot know;
      - after a number ("in 2020." or a list's "1."): unless a lowercase word or a lone mark follows.
    "e.g.", "etc." and "P.S." are ordinary words here, as in Punkt: they end a sentence, and so does each
    period of a spaced ellipsis ("wait . . . go" is four sentences). Periods inside a word ("3.5")
    end nothing. Closing quotes and brackets after the end stay with the sentence; text that is left over
    after them ('*"' after 'atoms?') counts as a sentence of its own, as in Punkt. An empty text has none.
    """
    starts, ends = [0], []
    for mark, word in _last_marks(text):
        if _ends_sentence(word, mark.group(), mark.group("punct") or mark.group("next")):
            ends.append(mark.end())
            starts.append(mark.start("next") if mark.group("next") else mark.end())
    ends.append(len(text.rstrip()))
    for index in range(1, len(starts)):  # a sentence's closing quotes and brackets move to the one before
        closing = _CLOSING.match(text, starts[index])
        if closing:
            starts[index] = closing.end()
    return sum(end > start for start, end in zip(starts, ends))


def _last_marks(text: str) -> list[tuple[re.Match[str], str]]:
    """The possible ends with the word each closes (back to the last space): of marks that touch ("acting!!!"),
    only the last; a mark right after a space starts a word of its own ("wait ! !" has two)."""
    marks: list[tuple[re.Match[str], str]] = []
    word_start = word_end = 0
    for mark in _MARK.finditer(text):
        between = text[word_end:mark.start()]
        space = max(between.rfind(char) for char in " \t\n\r\x0b\x0c")
        start = word_end + space + 1 if space > 0 else word_start  # as Punkt does, a space at 0 does not count
        if marks and word_end > start:
            marks.pop()  # this mark's word overlaps the last one's: the later mark decides
        marks.append((mark, text[start:mark.start()]))
        word_start, word_end = start, mark.start()
    return marks


def _ends_sentence(before: str, mark: str, following: str) -> bool:
    """Whether the mark, after the text `before` (back to the last space) and before `following` (the next word
    or the quote or bracket that touches the mark), ends a sentence."""
    if mark != ".":
        return True
    if before.endswith("."):
        return _capitalized_in(following, _STARTERS)  # an ellipsis
    # Punkt's word: it starts at the last quote, bracket or mark inside (kept when a word may start with it:
    # "DON'T." ends in the word "'T", no initial), after the opening brackets and quotes that stand alone.
    word = _AT_NOT_WORD.split(before)[-1].lstrip(_NO_WORD_START)
    if _is_abbreviation(word):
        return _capitalized_in(following, _STARTERS)
    if len(word) == 1 and word.isalpha():
        name_like = _INITIAL.match(following) or _is_abbreviation(following.removesuffix("."))  # "J. K.", "B. Mr."
        return not (word.lower() in _LETTER_ABBREVIATIONS or following[0].islower() or following[0] in ";:,.!?"
                    or name_like)
    if _NUMBER.fullmatch(word):
        return not (following[0].islower() or following[0] in ";:,.!?")
    return True


def _is_abbreviation(word: str) -> bool:
    lower = word.lower()
    if lower in _NOT_ABBREVIATIONS:
        return False
    return lower in _ABBREVIATIONS or lower.rpartition("-")[2] in _ABBREVIATIONS or bool(_DOTTED.fullmatch(word))


def _capitalized_in(following: str, words: frozenset[str]) -> bool:
    return following[0].isupper() and _NOT_WORD.split(following)[0].rstrip(".,;").lower() in words


# ---- capital words ------------------------------------------------------------------------------------------

# Where NLTK's word tokenizer cuts a word in two: these marks anywhere, a comma or colon before a non-digit,
# runs of periods, double hyphens; and "cannot", "gonna" and the like (_FUSED), "DON'T" before "N'T" (_CLITIC).
_CUT = re.compile(r"[\s;@#$%&?!*()\[\]{}<>\"`\u2012-\u2015\u00ab\u00bb\u201c\u201d\u2018\u2019\u201e]+"
                  r"|[,:](?!\d)|\.{2,}|--")
_FUSED = re.compile(r"(?i)\b(can)(not)\b|\b(d)('ye)\b|\b(gim)(me)\b|\b(gon)(na)\b|\b(got)(ta)\b|\b(lem)(me)\b"
                    r"|\b(more)('n)\b|\b(wan)(na)$")
_CLITIC = re.compile(r"(?<=[^'])(?:'[sSmMdD]|'ll|'LL|'re|'RE|'ve|'VE|n't|N'T|')$")


def count_capital_words(text: str) -> int:
    """Words in capital letters (str.isupper: a cased letter and no lowercase one, so "I", "U.S." and
    "COVID-19" count), as IFEval tokenizes them: "DON'T" is DO + N'T (2), "AT&T" is AT + T (2), "CANNOT" is
    CAN + NOT (2), "ROCK-SOLID", "I/O" and "O'NEIL" are one."""
    count = 0
    for piece in _CUT.split(text):
        for part in _split_clitic(piece):
            count += sum(1 for fused in _split_fused(part) if fused.isupper())
    return count


def _split_clitic(piece: str) -> tuple[str, ...]:
    # A sentence's final period is cut off first ("DON'T." is DO + N'T + .); a period inside a word stays.
    word = piece.removesuffix(".")
    match = _CLITIC.search(word)
    return (word[:match.start()], match.group()) if match and match.start() > 0 else (piece,)


def _split_fused(part: str) -> tuple[str, ...]:
    match = _FUSED.search(part)
    if match is None:
        return (part,)
    first, second = (g for g in match.groups() if g is not None)
    return part[:match.start()] + first, second + part[match.end():]


# ---- language -----------------------------------------------------------------------------------------------

def has_langdetect() -> bool:
    return importlib.util.find_spec("langdetect") is not None


@functools.lru_cache(maxsize=1)
def _detector_factory() -> Any:
    from langdetect.detector_factory import PROFILES_DIRECTORY, DetectorFactory

    factory = DetectorFactory()
    factory.load_profile(PROFILES_DIRECTORY)
    factory.seed = 0  # langdetect samples n-grams at random; a fixed seed makes the verdict a function of the text
    return factory


def detect_language(text: str) -> str | None:
    """langdetect's language code for the text, None where it finds nothing to go on (no letters)."""
    if not has_langdetect():
        raise ValueError(f"ifeval: this row's constraints detect the response's language, which needs langdetect: "
                         f"{EXTRA}")
    from langdetect.lang_detect_exception import LangDetectException

    detector = _detector_factory().create()
    detector.append(text)
    try:
        return detector.detect()
    except LangDetectException:
        return None


def _in_english(text: str) -> bool:
    return detect_language(text) in ("en", None)  # None: nothing to judge, counted as met (IFEval)


# ---- the checkers: (answer, kwargs) -> met ------------------------------------------------------------------

Args = Mapping[str, Any]


def _compare(count: int, relation: str, threshold: int) -> bool:
    return count < threshold if relation == "less than" else count >= threshold


def _literal(text: str) -> re.Pattern[str]:
    return re.compile(re.escape(text), re.IGNORECASE)


def _keywords_exist(text: str, args: Args) -> bool:
    return all(_literal(word).search(text) for word in args["keywords"])


def _keyword_frequency(text: str, args: Args) -> bool:
    # Occurrences anywhere, inside other words too ("war" in "toward"): IFEval counts substrings.
    found = len(_literal(args["keyword"].strip()).findall(text))
    return _compare(found, args["relation"], args["frequency"])


def _no_forbidden_words(text: str, args: Args) -> bool:
    return not any(re.search(rf"\b{re.escape(word)}\b", text, re.IGNORECASE) for word in args["forbidden_words"])


def _letter_frequency(text: str, args: Args) -> bool:
    found = collections.Counter(text.lower())[args["letter"].lower()]
    return _compare(found, args["let_relation"], args["let_frequency"])


def _response_language(text: str, args: Args) -> bool:
    code = detect_language(text)
    wanted = args["language"]
    return code is None or code == wanted or (wanted == "zh" and code in ("zh-cn", "zh-tw"))


def _number_sentences(text: str, args: Args) -> bool:
    return _compare(count_sentences(text), args["relation"], args["num_sentences"])


def _number_words(text: str, args: Args) -> bool:
    return _compare(count_words(text), args["relation"], args["num_words"])


_DIVIDER = re.compile(r"\s?\*\*\*\s?")


def _number_paragraphs(text: str, args: Args) -> bool:
    """Exactly num_paragraphs non-empty parts between `***` dividers; an empty part between two dividers fails."""
    parts = _DIVIDER.split(text)
    inner = parts[1:-1]
    if any(not part.strip() for part in inner):
        return False
    return sum(1 for part in parts if part.strip()) == args["num_paragraphs"]


def _nth_paragraph_first_word(text: str, args: Args) -> bool:
    """Exactly num_paragraphs non-empty paragraphs (split at each "\\n\\n"), and the nth piece of that split
    (empty pieces counted, as IFEval does) starts with first_word, compared in lower case up to its first
    . , ? ! ' or " (leading quotes skipped)."""
    pieces = text.split("\n\n")
    paragraphs = sum(1 for piece in pieces if piece.strip())
    nth = args["nth_paragraph"]
    if nth > paragraphs or not pieces[nth - 1].strip():
        return False
    word = pieces[nth - 1].split()[0].lstrip("'").lstrip('"')
    word = "".join(char.lower() for char in re.split(r"[.,?!'\"]", word, maxsplit=1)[0])
    return paragraphs == args["num_paragraphs"] and word == args["first_word"].lower()


def _number_placeholders(text: str, args: Args) -> bool:
    return count_placeholders(text) >= args["num_placeholders"]


def count_placeholders(text: str) -> int:
    """`[...]` spans within a line, as IFEval's `\\[.*?\\]` finds them, in one pass: from each `[` to the next
    `]` of its line (the regular expression, trying every `[` of a long line with no `]`, takes quadratic time)."""
    count = 0
    for line in text.split("\n"):
        end = 0
        while (start := line.find("[", end)) >= 0 and (end := line.find("]", start + 1)) >= 0:
            count += 1
            end += 1
    return count


def _postscript(text: str, args: Args) -> bool:
    """The marker anywhere in the answer, any case; "P.S." and "P.P.S" (as the data writes them) also with a
    space after their periods."""
    marker = args["postscript_marker"].strip()
    pattern = {"P.P.S": r"p\.\s?p\.\s?s", "P.S.": r"p\.\s?s\."}.get(marker, re.escape(marker.lower()))
    return re.search(pattern, text.lower()) is not None


def _number_bullet_lists(text: str, args: Args) -> bool:
    return count_bullets(text, "*") + count_bullets(text, "-") == args["num_bullets"]


_SPACE = re.compile(r"\s*")


def count_bullets(text: str, mark: str) -> int:
    """Lines that start, after spaces, with "*" and not "**" (mark "*") or with "-" (mark "-"): what IFEval's
    `^\\s*\\*[^\\*].*$` and `^\\s*-.*$` (multiline) find, in one pass. As there, the leading spaces may swallow
    blank lines above, and the character after "*" may be the line's end (the match then runs to the end of the
    next line). The expressions themselves retry every blank line of a long run: quadratic time."""
    count, start, size = 0, 0, len(text)
    while start < size:
        mark_at = _SPACE.match(text, start).end()  # every line start in this run of spaces gets here alike
        matched = mark_at < size and text[mark_at] == mark and (
            mark == "-" or mark_at + 1 < size and text[mark_at + 1] != "*")
        if matched:
            count += 1
            end = text.find("\n", mark_at + (2 if mark == "*" else 1))
            if end < 0:
                break
            start = end if text[end - 1] == "\n" else end + 1  # the next line start at or after the match's end
        else:
            end = text.find("\n", mark_at)
            if end < 0:
                break
            start = end + 1
    return count


_CONSTRAINED = ("My answer is yes.", "My answer is no.", "My answer is maybe.")


def _constrained_response(text: str, args: Args) -> bool:
    return any(option in text for option in _CONSTRAINED)


_SINGLE_STARS = re.compile(r"\*[^\n*]*\*")
_DOUBLE_STARS = re.compile(r"\*\*[^\n*]*\*\*")


def _number_highlighted_sections(text: str, args: Args) -> bool:
    """*text* spans with some non-space text, plus **text** spans likewise (each counted once: a "*" scan sees
    "**" as an empty span)."""
    single = sum(1 for span in _SINGLE_STARS.findall(text) if span.strip("*").strip())
    double = sum(1 for span in _DOUBLE_STARS.findall(text) if span[2:-2].strip())
    return single + double >= args["num_highlights"]


def _multiple_sections(text: str, args: Args) -> bool:
    """At least num_sections occurrences of the marker followed by a number ("SECTION 2"), case as given."""
    marker = re.escape(args["section_spliter"].strip())
    return len(re.split(rf"\s?{marker}\s?\d+\s?", text)) - 1 >= args["num_sections"]


def _json_format(text: str, args: Args) -> bool:
    """The whole answer parses as JSON, inside a ``` fence (```json, ```Json, ```JSON) or not."""
    text = text.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):
        text = text.removeprefix(fence)
    try:
        json.loads(text.removesuffix("```").strip())
    except (ValueError, RecursionError):  # RecursionError: arrays nested past json's limit are no answer either
        return False
    return True


def _title(text: str, args: Args) -> bool:
    return any(title.lstrip("<").rstrip(">").strip() for title in titles(text))


def titles(text: str) -> list[str]:
    """What IFEval's `<<[^\\n]+>>` finds, one per line at most: from a line's first `<<` to its last `>>` (greedy),
    with something between; in one pass (the expression retries every `<<` of a line with no `>>`)."""
    found = []
    for line in text.split("\n"):
        start, end = line.find("<<"), line.rfind(">>")
        if start >= 0 and end >= start + 3:
            found.append(line[start:end + 2])
    return found


def _two_responses(text: str, args: Args) -> bool:
    """Two different non-empty answers separated by "******" (empty parts only at the very start or end)."""
    parts = text.split("******")
    if any(not part.strip() for part in parts[1:-1]):
        return False
    answers = [part.strip() for part in parts if part.strip()]
    return len(answers) == 2 and answers[0] != answers[1]


def _repeat_prompt(text: str, args: Args) -> bool:
    return text.strip().lower().startswith(args["prompt_to_repeat"].strip().lower())


def _end_checker(text: str, args: Args) -> bool:
    return text.strip().strip('"').lower().endswith(args["end_phrase"].strip().lower())


def _capital_word_frequency(text: str, args: Args) -> bool:
    return _compare(count_capital_words(text), args["capital_relation"], args["capital_frequency"])


def _english_capital(text: str, args: Args) -> bool:
    return text.isupper() and _in_english(text)


def _english_lowercase(text: str, args: Args) -> bool:
    return text.islower() and _in_english(text)


def _no_comma(text: str, args: Args) -> bool:
    return "," not in text


def _quotation(text: str, args: Args) -> bool:
    text = text.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


# ---- the instructions and their kwargs ----------------------------------------------------------------------

_KINDS = {
    "count": "an integer >= 0",
    "relation": '"less than" or "at least"',
    "text": "a non-empty string",
    "words": "a non-empty list of non-empty strings",
    "language": "an ISO 639-1 code langdetect knows (" + ", ".join(LANGUAGES) + ")",
    "letter": "one character",
}


@dataclass(frozen=True)
class Instruction:
    """One IFEval instruction: its checker and its kwargs (name -> kind, every one required)."""

    check: Callable[[str, Args], bool]
    kwargs: Mapping[str, str]
    detects_language: bool = False


def _instruction(check: Callable[[str, Args], bool], detects_language: bool = False, **kwargs: str) -> Instruction:
    return Instruction(check, types.MappingProxyType(kwargs), detects_language)


INSTRUCTIONS: Mapping[str, Instruction] = types.MappingProxyType({
    "keywords:existence": _instruction(_keywords_exist, keywords="words"),
    "keywords:frequency": _instruction(_keyword_frequency, keyword="text", frequency="count", relation="relation"),
    "keywords:forbidden_words": _instruction(_no_forbidden_words, forbidden_words="words"),
    "keywords:letter_frequency": _instruction(_letter_frequency, letter="letter", let_frequency="count",
                                              let_relation="relation"),
    "language:response_language": _instruction(_response_language, True, language="language"),
    "length_constraints:number_sentences": _instruction(_number_sentences, num_sentences="count",
                                                        relation="relation"),
    "length_constraints:number_paragraphs": _instruction(_number_paragraphs, num_paragraphs="count"),
    "length_constraints:number_words": _instruction(_number_words, num_words="count", relation="relation"),
    "length_constraints:nth_paragraph_first_word": _instruction(_nth_paragraph_first_word, num_paragraphs="count",
                                                                nth_paragraph="count", first_word="text"),
    "detectable_content:number_placeholders": _instruction(_number_placeholders, num_placeholders="count"),
    "detectable_content:postscript": _instruction(_postscript, postscript_marker="text"),
    "detectable_format:number_bullet_lists": _instruction(_number_bullet_lists, num_bullets="count"),
    "detectable_format:constrained_response": _instruction(_constrained_response),
    "detectable_format:number_highlighted_sections": _instruction(_number_highlighted_sections,
                                                                  num_highlights="count"),
    "detectable_format:multiple_sections": _instruction(_multiple_sections, section_spliter="text",
                                                        num_sections="count"),
    "detectable_format:json_format": _instruction(_json_format),
    "detectable_format:title": _instruction(_title),
    "combination:two_responses": _instruction(_two_responses),
    "combination:repeat_prompt": _instruction(_repeat_prompt, prompt_to_repeat="text"),
    "startend:end_checker": _instruction(_end_checker, end_phrase="text"),
    "change_case:capital_word_frequency": _instruction(_capital_word_frequency, capital_frequency="count",
                                                       capital_relation="relation"),
    "change_case:english_capital": _instruction(_english_capital, True),
    "change_case:english_lowercase": _instruction(_english_lowercase, True),
    "punctuation:no_comma": _instruction(_no_comma),
    "startend:quotation": _instruction(_quotation),
})
"""The 25 instruction ids of IFEval's data, with the kwargs each takes (the data's names)."""

_FORMAT = ('{"instruction_id_list": ["punctuation:no_comma", ...], "kwargs": [{}, ...]}, one kwargs object per id '
           'as in the IFEval data')


def _takes(instruction_id: str) -> str:
    kwargs = INSTRUCTIONS[instruction_id].kwargs
    return ", ".join(f"{name} ({_KINDS[kind]})" for name, kind in kwargs.items()) or "no kwargs"


def _value(kind: str, value: Any) -> Any | None:
    """The kwarg's value in its kind, or None when it is not of that kind."""
    if kind == "count":
        if isinstance(value, float) and value.is_integer():  # 3.0: data that went through a float column
            value = int(value)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
    if kind == "relation":
        return value if value in RELATIONS else None
    if kind == "text":
        return value if isinstance(value, str) and value.strip() else None
    if kind == "words":
        ok = isinstance(value, list) and value and all(isinstance(w, str) and w.strip() for w in value)
        return tuple(value) if ok else None
    if kind == "language":
        return value if value in LANGUAGES else None
    return value if isinstance(value, str) and len(value) == 1 else None  # letter


def _kwargs(index: int, instruction_id: str, given: Any) -> Args:
    """One instruction's kwargs, checked: nulls dropped, every kwarg it takes present and of its kind, no other."""
    where = f"ifeval ground truth: kwargs[{index}] ({instruction_id})"
    if given is None:
        given = {}
    if not isinstance(given, Mapping):
        raise ValueError(f"{where} is {given!r}, not an object; give {{}} or its kwargs: {_takes(instruction_id)}")
    given = {name: value for name, value in given.items() if value is not None}
    takes = INSTRUCTIONS[instruction_id].kwargs
    extra = sorted(set(given) - set(takes))
    if extra:
        raise ValueError(f"{where} has {', '.join(map(repr, extra))}, which {instruction_id} does not take (it takes "
                         f"{_takes(instruction_id)}); remove it or set it to null")
    missing = [name for name in takes if name not in given]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(map(repr, missing))}; {instruction_id} takes "
                         f"{_takes(instruction_id)}")
    args = {}
    for name, kind in takes.items():
        args[name] = _value(kind, given[name])
        if args[name] is None:
            raise ValueError(f"{where}: {name} must be {_KINDS[kind]}, got {given[name]!r}")
    if "nth_paragraph" in args and not 1 <= args["nth_paragraph"] <= args["num_paragraphs"]:
        raise ValueError(f"{where}: nth_paragraph must be between 1 and num_paragraphs "
                         f"({args['num_paragraphs']}), got {args['nth_paragraph']}")
    return types.MappingProxyType(args)


# ---- ground truth -------------------------------------------------------------------------------------------

Constraint = tuple[str, Args]
_RECORD_KEYS = {"instruction_id_list", "kwargs", "key", "prompt"}  # key and prompt: the rest of an IFEval record


def parse_ground_truth(ground_truth: str | Mapping[str, Any]) -> tuple[Constraint, ...]:
    """The (instruction id, kwargs) pairs of a row's ground truth; ValueError naming the problem and the fix."""
    if isinstance(ground_truth, str):
        return _parse_text(ground_truth)
    return _parse_record(ground_truth)


@functools.lru_cache(maxsize=4096)  # every sample of a prompt carries the same ground truth
def _parse_text(text: str) -> tuple[Constraint, ...]:
    try:
        record = json.loads(text)
    except ValueError as error:
        raise ValueError(f"ifeval ground truth is not JSON ({error}): {text[:80]!r}; give {_FORMAT}") from None
    return _parse_record(record)


def _parse_record(record: Any) -> tuple[Constraint, ...]:
    if not isinstance(record, Mapping) or not {"instruction_id_list", "kwargs"} <= set(record):
        raise ValueError(f"ifeval ground truth: {str(record)[:80]!r} lacks instruction_id_list or kwargs; "
                         f"give {_FORMAT}")
    other = sorted(set(record) - _RECORD_KEYS)
    if other:
        raise ValueError(f"ifeval ground truth has {', '.join(map(repr, other))}; it holds instruction_id_list "
                         "and kwargs only")
    ids, kwargs = record["instruction_id_list"], record["kwargs"]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise ValueError(f"ifeval ground truth: instruction_id_list must be a non-empty list of instruction ids, "
                         f"got {ids!r}")
    if not isinstance(kwargs, list) or len(kwargs) != len(ids):
        size = f"{len(kwargs)} kwargs entries" if isinstance(kwargs, list) else f"kwargs {kwargs!r}"
        raise ValueError(f"ifeval ground truth: {len(ids)} instruction ids but {size}; give a list with one kwargs "
                         "object per id ({} for an id that takes none)")
    for index, instruction_id in enumerate(ids):
        if instruction_id not in INSTRUCTIONS:
            raise ValueError(f"ifeval ground truth: unknown instruction id {instruction_id!r} (instruction_id_list"
                             f"[{index}]); the known ones: {', '.join(INSTRUCTIONS)}")
    return tuple((i, _kwargs(index, i, given)) for index, (i, given) in enumerate(zip(ids, kwargs)))


def check_ground_truth(text: str | Mapping[str, Any]) -> None:
    """Start-up check of one row's ground truth: a ValueError naming its problem and the fix (a bad id or kwarg,
    or a constraint on the response's language without the `ifeval` extra), None when the row can be scored."""
    constraints = parse_ground_truth(text)
    needs = [i for i, _ in constraints if INSTRUCTIONS[i].detects_language]
    if needs and not has_langdetect():
        raise ValueError(f"ifeval ground truth: {needs[0]} detects the response's language, which needs "
                         f"langdetect: {EXTRA}")


# ---- scoring ------------------------------------------------------------------------------------------------

def answer_variants(answer: str, *, strict: bool = True) -> tuple[str, ...]:
    """The texts a constraint may hold on: the answer; in loose mode also the answer without its first line,
    its last line or both, and each of those four without any `*` (IFEval's loose accuracy)."""
    if strict:
        return (answer,)
    lines = answer.split("\n")
    cut = ("\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip())
    return (answer, answer.replace("*", ""), *cut, *(text.replace("*", "") for text in cut))


def follows(answer: str, instruction_id: str, args: Args, *, strict: bool = True) -> bool:
    """Whether the answer meets one constraint; an empty answer meets none."""
    check = INSTRUCTIONS[instruction_id].check
    return any(text.strip() and check(text, args) for text in answer_variants(answer, strict=strict))


def ifeval_reward(completion: str, ground_truth: str, *, require_all: bool = False, strict: bool = True) -> Verdict:
    """The fraction of the row's constraints the answer meets (1/0 with require_all); passed when all are met,
    reason "ok" or "failed: ID" (the first unmet), "no_answer" for a think that never closes."""
    constraints = parse_ground_truth(ground_truth)
    answer = final_part(completion)
    if answer is None:
        return NO_ANSWER
    if THINK_CLOSE in completion:
        answer = answer.lstrip()  # the "\n\n" a chat template puts after </think> is not part of the answer
    met = [follows(answer, i, args, strict=strict) for i, args in constraints]
    failed = next((i for (i, _), ok in zip(constraints, met) if not ok), None)
    reward = float(failed is None) if require_all else sum(met) / len(met)
    return Verdict(reward=reward, passed=failed is None, reason="ok" if failed is None else f"failed: {failed}")


def ifeval_verifier(*, all: bool = False, strict: bool = True) -> Callable[[str, str, Prompt], Verdict]:  # noqa: A002
    """The registry's `ifeval`. Options: `all` (reward 1 only when every constraint is met, else 0; default: the
    fraction met) and `strict` (IFEval's strict mode; false: loose)."""
    require_all = all  # `all` is the option's name in a recipe; the builtin is not needed here
    if not isinstance(require_all, bool) or not isinstance(strict, bool):
        raise ValueError(f"ifeval: options all and strict are true or false, got all={require_all!r}, "
                         f"strict={strict!r}")

    def score(completion: str, ground_truth: str, prompt: Prompt) -> Verdict:
        return ifeval_reward(completion, ground_truth, require_all=require_all, strict=strict)
    return score
