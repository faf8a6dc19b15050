r"""Text verifiers of the registry: `choice`, `exact`, `regex` and `format`. Pure functions, no I/O.

All but `format` read the final answer: what follows the last `</think>`, the whole completion when it has no
think, nothing (reason no_answer) when a `<think>` never closes, as verifiers/math.py does.

`choice` reads a multiple-choice letter from the final answer, by the first rule that finds one:
  1. the last `\boxed{...}` that holds an option ("\boxed{C}", "\boxed{\text{(C)}}", "\boxed{Paris}");
  2. the last answer marker ("answer is", "answer:", "choice is", "option:", ...) followed by an option:
     "(C)", "[C]", "C)", "C", "C.", "option C", an option's text; lower case only in brackets or alone;
  3. the whole answer as one option: "C", "c", "(C)", "C) 42" (the letter then its own text), "42";
  4. the last standalone capital letter of `letters`: not inside a word ("CAT"), not the article or the
     pronoun ("A cat", "I think").
Markdown bold is ignored. Options' texts come from the prompt's lines that start with a label: "A) 42",
"(B) 42", "[C] 42", "D. 42", "E: 42" (capital letters only; the last line with a letter wins, so few-shot
examples above the question do not count). A text matches an option when both are equal after folding case,
spaces, `$` and a final period, and only when no other option has the same text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from flashreinforce.data.arithmetic import THINK_CLOSE, THINK_OPEN
from flashreinforce.types import NO_ANSWER, Prompt, Verdict
from flashreinforce.verifiers.registry import check_bool_options

Scorer = Callable[[str, str, Prompt], Verdict]

OK = Verdict(reward=1.0, passed=True, reason="ok")
WRONG = Verdict(reward=0.0, passed=False, reason="wrong")


def final_part(completion: str, *, think_open: str = THINK_OPEN, think_close: str = THINK_CLOSE) -> str | None:
    """What follows the last think_close; the whole completion without a think; None for a think never closed."""
    closed = completion.rfind(think_close)
    if closed >= 0:
        return completion[closed + len(think_close):]
    if think_open in completion:
        return None  # still thinking when it stopped: whatever it wrote is scratch work
    return completion


# ---- choice -------------------------------------------------------------------------------------------------

_BOLD = re.compile(r"\*\*|__")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{((?:[^{}]|\{[^{}]*\})*)\}")  # one level of inner braces: \text{C}
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf)\s*\{([^{}]*)\}")
_MARKER = re.compile(r"\b(?:answer|choice|option)\s*(?:is\s*:?|:|=)\s*", re.IGNORECASE)
_MARKER_WORD = re.compile(r"(?:option|choice|letter)\s+", re.IGNORECASE)  # "the answer is option C"
_BRACKETED = re.compile(r"[(\[]?([A-Za-z])[)\]]")  # "(C)", "[c]", "C)"
_CAPITAL = re.compile(r"([A-Z])(?![\w'’-])")  # "C", "C.", "C, since" but not "Cat", "I'd", "X-ray"
_LONE = re.compile(r"([A-Za-z])[.!]?")  # the span is the letter and nothing else: "c", "c."
_PRONOUN = re.compile(r"I\s+[a-z]")  # "answer: I think it is B": the pronoun, not option I
_WORD_USE = re.compile(r"[AI]\s+[a-z]")  # "A cat", "I think": the article and the pronoun
_STANDALONE = re.compile(r"(?<![\w'’\\-])([A-Z])(?![\w'’-])")
_LABELLED = re.compile(r"(?:\(([A-Za-z])\)|\[([A-Za-z])\]|([A-Za-z])[.):]?)(?:\s+(.*))?", re.DOTALL)
_OPTION_LINE = re.compile(r"^[ \t]*(?:\(([A-Z])\)|\[([A-Z])\]|([A-Z])[.):])[ \t]+(\S[^\n]*?)[ \t]*$", re.MULTILINE)
_SENTENCE_END = re.compile(r"[.!?](?:\s|$)")
MARKER_WINDOW = 1024
"""How far past an answer marker its option is looked for (an option's text is shorter)."""
MAX_MARKERS = 64
"""The answer markers read, from the last: a response that names no option after its last 64 names none."""


def prompt_options(prompt: Prompt | str | None, letters: str = "ABCDEFGHIJ") -> dict[str, str]:
    """The options the prompt lists, letter -> text, from lines such as "A) 42", "(B) 42", "C. 42".

    Chat prompts: the last user message (the question; earlier turns may hold few-shot examples). A letter
    listed twice keeps its last line.
    """
    text = prompt.prompt if isinstance(prompt, Prompt) else prompt or ""
    if not isinstance(text, str):
        users = [m.get("content", "") for m in text if m.get("role") == "user"]
        text = users[-1] if users else "\n".join(m.get("content", "") for m in text)
    options = {}
    for match in _OPTION_LINE.finditer(text):
        letter = match[1] or match[2] or match[3]
        if letter in letters:
            options[letter] = match[4]
    return options


def extract_choice(answer: str, *, letters: str = "ABCDEFGHIJ",
                   options: Mapping[str, str] | None = None) -> str | None:
    """The option letter an answer text (already past its think) chooses, or None; the module doc has the rules.

    >>> extract_choice("Let me see. **The answer is (c)**", letters="ABCD")
    'C'
    >>> extract_choice("Paris", letters="ABCD", options={"A": "Rome", "B": "Paris"})
    'B'
    """
    text = _BOLD.sub("", answer)
    folded = {letter: _fold(option) for letter, option in (options or {}).items()}
    for rule in (_from_boxed, _from_marker, _from_whole, _from_standalone):
        letter = rule(text, letters, folded)
        if letter is not None:
            return letter
    return None


def _from_boxed(text: str, letters: str, options: Mapping[str, str]) -> str | None:
    for match in reversed(list(_BOXED.finditer(text))):
        letter = _option_in(match[1], letters, options)
        if letter is not None:
            return letter
    return None


def _from_marker(text: str, letters: str, options: Mapping[str, str]) -> str | None:
    for match in list(_MARKER.finditer(text))[::-1][:MAX_MARKERS]:
        # The answer may sit on the next line ("Answer:\n\nC"), but never further than one line on; reading a
        # window of the last markers, not the rest of the text after each, keeps a text of many markers fast.
        span = text[match.end():match.end() + MARKER_WINDOW].lstrip().split("\n", 1)[0]
        letter = _option_in(span, letters, options)
        if letter is not None:
            return letter
    return None


def _from_whole(text: str, letters: str, options: Mapping[str, str]) -> str | None:
    """The whole answer is one option: its letter, alone or followed by its own text, or its text alone."""
    text = _plain(text)
    labelled = _LABELLED.fullmatch(text)
    if labelled is not None:
        letter = (labelled[1] or labelled[2] or labelled[3]).upper()
        rest = labelled[4] or ""
        # "A cat" is prose unless "cat" is option A's text, and "C) 41" is no answer when C says 42.
        if letter in letters and (not rest or _fold(rest) == options.get(letter)):
            return letter
    return _letter_of_text(text, options)


def _from_standalone(text: str, letters: str, options: Mapping[str, str]) -> str | None:
    for match in reversed(list(_STANDALONE.finditer(text))):
        if match[1] in letters and not _WORD_USE.match(text, match.start()):
            return match[1]
    return None


def _option_in(span: str, letters: str, options: Mapping[str, str]) -> str | None:
    """The option a span after a marker or inside a box starts with: a label, or an option's whole text."""
    span = _plain(span)
    word = _MARKER_WORD.match(span)
    if word is not None:
        span = span[word.end():]
    for match in (_BRACKETED.match(span), _CAPITAL.match(span), _LONE.fullmatch(span)):
        if match is not None and match[1].upper() in letters and not _PRONOUN.match(span, match.start()):
            return match[1].upper()
    sentence = _SENTENCE_END.split(span, maxsplit=1)[0]
    return _letter_of_text(span, options) or _letter_of_text(sentence, options)


def _letter_of_text(text: str, options: Mapping[str, str]) -> str | None:
    """The one option whose folded text is this text's; None when none or several are."""
    folded = _fold(text)
    found = [letter for letter, option in options.items() if option == folded]
    return found[0] if len(found) == 1 and folded else None


def _plain(text: str) -> str:
    return _LATEX_TEXT.sub(r"\1", text).strip().strip("$").strip()


def _fold(text: str) -> str:
    """What makes two option texts the same answer: case, spacing, `$`, bold, quotes and a final period do not."""
    text = _BOLD.sub("", text).replace("$", "").strip().strip("\"'`").rstrip(".").strip()
    return " ".join(text.casefold().split())


def _check_letters(letters: object) -> str:
    if not isinstance(letters, str) or not re.fullmatch(r"[A-Za-z]+", letters) \
            or len(set(letters.upper())) != len(letters):
        raise ValueError(f"choice: option `letters` is {letters!r}; give the option letters as one string of "
                         "distinct letters, e.g. letters: ABCD")
    return letters.upper()


def _truth_letter(ground_truth: str, letters: str, options: Mapping[str, str]) -> str | None:
    """The ground truth as a letter: "C", "(C)", "c." or the text of one of the prompt's options."""
    truth = _plain(ground_truth)
    labelled = re.fullmatch(r"[(\[]?([A-Za-z])[)\].]?", truth)
    if labelled is not None and labelled[1].upper() in letters:
        return labelled[1].upper()
    return _letter_of_text(truth, {letter: _fold(text) for letter, text in options.items()})


def choice_verifier(*, letters: str = "ABCDEFGHIJ", match_text: bool = True, after_think: bool = True) -> Scorer:
    """The registry's `choice`: 1 when the completion chooses the ground truth's option (rules: module doc).

    letters: the option letters; match_text: an answer may give an option's text instead of its letter (when
    the prompt lists the options); after_think: read only what follows `</think>`. The ground truth is a
    letter or the text of one of the prompt's options; any other is reason "bad_ground_truth: ...".
    """
    letters = _check_letters(letters)
    check_bool_options("choice", match_text=match_text, after_think=after_think)

    def score(completion: str, ground_truth: str, prompt: Prompt) -> Verdict:
        options = prompt_options(prompt, letters)
        truth = _truth_letter(ground_truth, letters, options)
        if truth is None:
            return Verdict(reward=0.0, passed=False,
                           reason=f"bad_ground_truth: {ground_truth!r} is neither one of the letters {letters} "
                                  f"nor the text of an option the prompt lists ({', '.join(options) or 'none'})")
        answer = final_part(completion) if after_think else completion
        chosen = None if answer is None else extract_choice(
            answer, letters=letters, options=options if match_text else None)
        if chosen is None:
            return NO_ANSWER
        return OK if chosen == truth else WRONG
    return score


# ---- exact and regex ----------------------------------------------------------------------------------------

def exact_verifier(*, strip: bool = True, case_sensitive: bool = True, after_think: bool = True) -> Scorer:
    """The registry's `exact`: 1 when the final answer is the ground truth, character for character.

    strip: both lose their surrounding whitespace first; case_sensitive: False compares them case-folded;
    after_think: compare only what follows `</think>`. An empty answer is reason no_answer.
    """
    check_bool_options("exact", strip=strip, case_sensitive=case_sensitive, after_think=after_think)

    def score(completion: str, ground_truth: str, prompt: Prompt) -> Verdict:
        answer = final_part(completion) if after_think else completion
        if answer is None:
            return NO_ANSWER
        truth = ground_truth
        if strip:
            answer, truth = answer.strip(), truth.strip()
        if not answer:
            return NO_ANSWER
        if not case_sensitive:
            answer, truth = answer.casefold(), truth.casefold()
        return OK if answer == truth else WRONG
    return score


GROUND_TRUTH = "{ground_truth}"
"""In a regex pattern, stands for the row's ground truth (stripped, matched literally)."""
_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE, "a": re.ASCII}


def regex_verifier(*, pattern: str | None = None, flags: str = "", match: str = "full",
                   after_think: bool = True) -> Scorer:
    """The registry's `regex`: 1 when the final answer matches a regular expression (Python `re` syntax).

    pattern: the expression; `{ground_truth}` in it stands for the row's ground truth, stripped and escaped
    (matched as literal text); a pattern without it ignores the ground truth. Without a pattern, the ground
    truth is the pattern (one that does not compile is reason "bad_ground_truth: ..."). flags: letters of
    i (ignore case), m (multiline), s (dot matches newline), x (verbose), a (ASCII). match: `full` (the whole
    stripped answer) or `search` (anywhere in it). An empty answer is reason no_answer.
    """
    bits = _regex_flags("regex", flags)
    if match not in ("full", "search"):
        raise ValueError(f"regex: option `match` is {match!r}; use full (the whole answer) or search (anywhere)")
    check_bool_options("regex", after_think=after_think)
    fixed = None
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"regex: option `pattern` is {pattern!r}; give a non-empty regular expression, or "
                             "leave it out to use each row's ground truth as the pattern")
        # The ground truth goes in escaped, so a pattern that compiles with any literal there always compiles.
        compiled = _compile("regex", "pattern", pattern.replace(GROUND_TRUTH, "x"), bits)
        fixed = None if GROUND_TRUTH in pattern else compiled

    def score(completion: str, ground_truth: str, prompt: Prompt) -> Verdict:
        answer = final_part(completion) if after_think else completion
        if answer is None or not answer.strip():
            return NO_ANSWER
        if fixed is not None:
            expression = fixed
        else:
            source = ground_truth if pattern is None else \
                pattern.replace(GROUND_TRUTH, re.escape(ground_truth.strip()))
            try:
                expression = re.compile(source, bits)  # re caches compiled patterns across calls
            except re.error as error:
                return Verdict(reward=0.0, passed=False,
                               reason=f"bad_ground_truth: {ground_truth!r} is not a regular expression ({error})")
        found = expression.fullmatch(answer.strip()) if match == "full" else expression.search(answer)
        return OK if found else WRONG
    return score


def _regex_flags(kind: str, flags: object) -> int:
    if not isinstance(flags, str) or any(letter not in _FLAGS for letter in flags):
        raise ValueError(f"{kind}: option `flags` is {flags!r}; use letters of {''.join(_FLAGS)} (i: ignore case, "
                         "m: multiline, s: dot matches newline, x: verbose, a: ASCII), e.g. flags: is")
    bits = 0
    for letter in flags:
        bits |= _FLAGS[letter]
    return bits


def _compile(kind: str, option: str, pattern: str, bits: int) -> re.Pattern[str]:
    try:
        return re.compile(pattern, bits)
    except re.error as error:
        raise ValueError(f"{kind}: option `{option}` {pattern!r} is not a regular expression ({error}); "
                         "fix it (Python re syntax; in YAML, quote it with single quotes)") from None


# ---- format -------------------------------------------------------------------------------------------------

SHAPES = ("think_answer", "think_answer_tags")


def format_verifier(*, shape: str = "think_answer", pattern: str | None = None, flags: str = "",
                    think_open: str = THINK_OPEN, think_close: str = THINK_CLOSE, answer_open: str = "<answer>",
                    answer_close: str = "</answer>", think_in_prompt: bool = False) -> Scorer:
    """The registry's `format`: 1 when the completion has the shape, else 0 with reason "bad_format: <what>".

    shape think_answer: `<think>...</think>` then a non-empty answer, nothing before `<think>` but whitespace,
    one think only (it may be empty). think_answer_tags: the same, the answer being `<answer>...</answer>`
    (non-empty) and nothing after it. think_in_prompt: the prompt already opened the think, so the completion
    starts inside it and only closes it. pattern: instead of a shape, a regular expression the whole completion
    must match (flags as for `regex`; `.` crosses lines only with s). The ground truth is not read.
    """
    check_bool_options("format", think_in_prompt=think_in_prompt)
    bits = _regex_flags("format", flags)
    if flags and pattern is None:
        raise ValueError("format: option `flags` applies to `pattern` only; give a pattern or drop flags")
    tags = {"think_open": think_open, "think_close": think_close, "answer_open": answer_open,
            "answer_close": answer_close}
    for name, tag in tags.items():
        if not isinstance(tag, str) or not tag.strip():
            raise ValueError(f"format: option `{name}` is {tag!r}; give the tag's text, e.g. {name}: '<think>'")
    if len(set(tags.values())) < len(tags):
        raise ValueError(f"format: the tags {tags} repeat one; give each of them its own text")
    if pattern is not None:
        if shape != "think_answer":
            raise ValueError(f"format: both `shape` ({shape!r}) and `pattern` given; give one of them")
        expression = _compile("format", "pattern", pattern, bits)
        return lambda completion, ground_truth, prompt: (
            OK if expression.fullmatch(completion) else _bad_format(f"the response does not match {pattern!r}"))
    if shape not in SHAPES:
        raise ValueError(f"format: option `shape` is {shape!r}; use one of {', '.join(SHAPES)}, or give `pattern`")

    def score(completion: str, ground_truth: str, prompt: Prompt) -> Verdict:
        answer, problem = _after_one_think(completion, think_open, think_close, think_in_prompt)
        if problem is None and shape == "think_answer_tags":
            problem = _tagged_answer_problem(answer, answer_open, answer_close)
        return OK if problem is None else _bad_format(problem)
    return score


def _after_one_think(completion: str, think_open: str, think_close: str, in_prompt: bool) -> tuple[str, str | None]:
    """(what follows the think, the first problem with the think and a non-empty answer after it, or None)."""
    body = completion.lstrip()
    if not in_prompt:
        if not body.startswith(think_open):
            where = "text before" if think_open in body else "no"
            return "", f"{where} {think_open}"
        body = body[len(think_open):]
    if think_open in body:
        return "", f"more than one {think_open}"
    closes = body.count(think_close)
    if closes != 1:
        return "", f"no {think_close}" if closes == 0 else f"more than one {think_close}"
    answer = body.split(think_close, 1)[1]
    if not answer.strip():
        return answer, f"nothing after {think_close}"
    return answer, None


def _tagged_answer_problem(answer: str, answer_open: str, answer_close: str) -> str | None:
    answer = answer.strip()
    if not answer.startswith(answer_open):
        return f"the answer does not start with {answer_open}"
    if not answer.endswith(answer_close) or answer.count(answer_open) != 1 or answer.count(answer_close) != 1:
        return f"the answer is not one {answer_open}...{answer_close} with nothing after it"
    if not answer[len(answer_open):-len(answer_close)].strip():
        return f"empty {answer_open}"
    return None


def _bad_format(problem: str) -> Verdict:
    return Verdict(reward=0.0, passed=False, reason=f"bad_format: {problem}")
