"""The registry's text verifiers, `choice`, `exact`, `regex` and `format`, built from specs the way the verifier
pool's workers build them (load_reward_fn of spec_ref), and the `math` + `format` weighted sum."""

import pytest

from flashreinforce.types import Prompt
from flashreinforce.verifiers.registry import build_verifier, parse_spec, spec_ref
from flashreinforce.verifiers.rewards import load_reward_fn
from flashreinforce.verifiers.text import extract_choice, prompt_options

QUESTION = "What is the capital of France?\nA) Rome\nB) Paris\n(C) 42\nD. London\nAnswer with a letter."
MCQ = Prompt(id="q", prompt=QUESTION, ground_truth="B", data_source="mcq")
OPTIONS = {"A": "Rome", "B": "Paris", "C": "42", "D": "London"}


def verifier(spec):
    """The verifier of a spec, through the reference string that carries it to a worker process."""
    return load_reward_fn(spec_ref(parse_spec(spec)))


def verdict_of(spec, completion, ground_truth, prompt=MCQ):
    v = verifier(spec)(completion, ground_truth, prompt)
    return v.reward, v.passed, v.reason


# ---- choice -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("answer", "letter"), [
    ("The answer is (C)", "C"),
    ("Answer: C", "C"),
    ("**C**", "C"),
    ("C) 42", "C"),
    (r"\boxed{C}", "C"),
    (r"so \boxed{\text{(C)}}.", "C"),
    ("C", "C"),
    ("c", "C"),                                   # lower case alone is a letter
    ("The correct option is [d].", "D"),          # lower case in brackets too
    ("Answer:\n\n**D**", "D"),                   # the answer on the line after the marker
    ("The answer is option D.", "D"),
    ("The final answer is B) Paris", "B"),
    ("Paris", "B"),                               # an option's text, case and a final period aside
    ("The answer is paris.", "B"),
    (r"\boxed{London}", "D"),
    ("A lion? No. Looking at the options, Rome is not it. B", "B"),  # the last standalone letter
    # several letters: the last answer marker wins over earlier ones and over letters after it
    ("The answer is A. Wait, no: the answer is B. (C was a trap.)", "B"),
    (r"The answer is A, so \boxed{D}", "D"),     # a box wins over a marker
    ("It is C, not D", "D"),                      # no marker: the last standalone letter, as documented
    ("Answer: I think it is B", "B"),             # the pronoun I is not option I
])
def test_choice_finds_the_letter(answer, letter):
    assert extract_choice(answer, letters="ABCDEFGHIJ", options=OPTIONS) == letter


@pytest.mark.parametrize("answer", [
    "",
    "   ",
    "CAT DOG",                   # letters inside words
    "I'd say a bird.",           # the pronoun and the article, lower-case a
    "A cat sat on it",           # "A" the article: option A's text is not "cat"
    "The answer is E",           # not one of the letters ABCD
    "Madrid",                    # no option has this text
    "option b",                  # lower case after no marker
])
def test_choice_finds_no_letter(answer):
    assert extract_choice(answer, letters="ABCD", options=OPTIONS) is None


def test_choice_reads_only_the_final_answer_and_its_verdicts_say_why():
    assert verdict_of("choice", "<think>maybe A? The answer is A</think>The answer is (B)", "B") == (1.0, True, "ok")
    assert verdict_of("choice", "<think>The answer is B</think>The answer is A", "B") == (0.0, False, "wrong")
    assert verdict_of("choice", "<think>The answer is B, so", "B") == (0.0, False, "no_answer")  # never closed
    assert verdict_of("choice", "<think>B</think>", "B") == (0.0, False, "no_answer")
    assert verdict_of("choice", "", "B") == (0.0, False, "no_answer")
    # after_think off: the think is read like the rest
    assert verdict_of({"kind": "choice", "after_think": False}, "<think>The answer is B", "B")[2] == "ok"


def test_choice_ground_truth_is_a_letter_or_an_options_text():
    assert verdict_of("choice", "B", "(b)")[2] == "ok"
    assert verdict_of("choice", "The answer is B.", "Paris")[2] == "ok"
    assert verdict_of("choice", "The answer is A.", "paris.")[2] == "wrong"
    reward, passed, reason = verdict_of("choice", "B", "Berlin")
    assert (reward, passed) == (0.0, False)
    assert reason.startswith("bad_ground_truth: 'Berlin' is neither one of the letters ABCDEFGHIJ nor the text")


def test_choice_option_texts_come_from_the_prompt_and_can_be_turned_off():
    assert verdict_of({"kind": "choice", "match_text": False}, "Paris", "B")[2] == "no_answer"
    assert verdict_of({"kind": "choice", "match_text": False}, "The answer is B", "Paris")[2] == "ok"
    no_options = Prompt(id="n", prompt="Pick A or B.", ground_truth="B")
    assert verdict_of("choice", "Paris", "B", no_options)[2] == "no_answer"
    assert verdict_of({"kind": "choice", "letters": "AB"}, "The answer is C", "B", no_options)[2] == "no_answer"


def test_prompt_options_read_the_question_not_the_examples_and_skip_ambiguous_texts():
    chat = Prompt(id="c", ground_truth="A", prompt=(
        {"role": "user", "content": "Example:\nA) 1\nB) 2"}, {"role": "assistant", "content": "A"},
        {"role": "user", "content": "Which is even?\nA) 4\nB) 5"}))
    assert prompt_options(chat) == {"A": "4", "B": "5"}
    few_shot = "Q1\nA) 1\nB) 2\nAnswer: A\n\nQ2\nA) 7\nB) 8\nC) 9"
    assert prompt_options(few_shot) == {"A": "7", "B": "8", "C": "9"}  # a letter's last line wins
    assert prompt_options("A) 1\nZ) 2", letters="ABCD") == {"A": "1"}
    twins = Prompt(id="t", prompt="A) yes\nB) Yes\nC) no", ground_truth="C")
    assert verdict_of("choice", "yes", "C", twins)[2] == "no_answer"  # "yes" is A and B: neither
    assert verdict_of("choice", "no", "C", twins)[2] == "ok"


@pytest.mark.parametrize("letters", ["", "AAB", "A1", 5])
def test_choice_letters_are_distinct_letters(letters):
    with pytest.raises(ValueError, match=r"choice: option `letters` is .*; give the option letters as one string"):
        verifier({"kind": "choice", "letters": letters})


def test_choice_letters_may_be_given_in_lower_case_and_options_are_checked():
    assert verdict_of({"kind": "choice", "letters": "abcd"}, "The answer is (b)", "B")[2] == "ok"
    with pytest.raises(ValueError, match=r"verifier: choice has no option 'letter'; its options: letters, "):
        verifier({"kind": "choice", "letter": "AB"})
    with pytest.raises(ValueError, match=r"choice: option `match_text` is 'yes'; use true or false"):
        verifier({"kind": "choice", "match_text": "yes"})


# ---- exact --------------------------------------------------------------------------------------------------

def test_exact_compares_the_final_answer_with_the_ground_truth():
    assert verdict_of("exact", "<think>is it paris?</think> Paris\n", "Paris") == (1.0, True, "ok")
    assert verdict_of("exact", "Paris.", "Paris") == (0.0, False, "wrong")
    assert verdict_of("exact", "paris", "Paris")[2] == "wrong"
    assert verdict_of({"kind": "exact", "case_sensitive": False}, "PARIS", "paris")[2] == "ok"
    assert verdict_of({"kind": "exact", "strip": False}, " Paris", "Paris")[2] == "wrong"
    assert verdict_of({"kind": "exact", "strip": False}, "Paris", "Paris")[2] == "ok"
    assert verdict_of("exact", "<think>Paris", "Paris")[2] == "no_answer"
    assert verdict_of("exact", "<think>Paris</think>  ", "Paris")[2] == "no_answer"
    assert verdict_of({"kind": "exact", "after_think": False}, "<think>x</think>Paris", "Paris")[2] == "wrong"
    with pytest.raises(ValueError, match=r"exact: option `strip` is 1; use true or false"):
        verifier({"kind": "exact", "strip": 1})


# ---- regex --------------------------------------------------------------------------------------------------

def test_regex_with_a_pattern_ignores_the_ground_truth_unless_the_pattern_names_it():
    three_digits = {"kind": "regex", "pattern": r"\d{3}"}  # a quantifier's braces are not a placeholder
    assert verdict_of(three_digits, "<think>hm</think> 123 ", "anything") == (1.0, True, "ok")
    assert verdict_of(three_digits, "1234", "anything")[2] == "wrong"  # full match by default
    assert verdict_of({**three_digits, "match": "search"}, "it is 1234", "x")[2] == "ok"
    named = {"kind": "regex", "pattern": "x = {ground_truth}", "flags": "i"}
    assert verdict_of(named, "X = 1+1", "1+1")[2] == "ok"  # the ground truth is literal text: + is a plus
    assert verdict_of(named, "x = 11", "1+1")[2] == "wrong"
    assert verdict_of(named, "x = a.c", "a.c")[2] == "ok"
    assert verdict_of(named, "x = abc", "a.c")[2] == "wrong"


def test_regex_without_a_pattern_uses_the_ground_truth_as_the_pattern():
    assert verdict_of("regex", "Paris", "(?i)paris|lutetia")[2] == "ok"
    assert verdict_of("regex", "Lyon", "(?i)paris|lutetia")[2] == "wrong"
    assert verdict_of("regex", "<think>x", "x")[2] == "no_answer"
    assert verdict_of("regex", "", ".*")[2] == "no_answer"
    reward, passed, reason = verdict_of("regex", "Paris", "(unclosed")
    assert (reward, passed) == (0.0, False) and reason.startswith("bad_ground_truth: '(unclosed' is not a regular")


def test_regex_options_are_checked_when_built():
    with pytest.raises(ValueError, match=r"regex: option `pattern` '\(unclosed' is not a regular expression"):
        verifier({"kind": "regex", "pattern": "(unclosed"})
    with pytest.raises(ValueError, match=r"regex: option `pattern` is ''"):
        verifier({"kind": "regex", "pattern": ""})
    with pytest.raises(ValueError, match=r"regex: option `flags` is 'iq'; use letters of imsxa"):
        verifier({"kind": "regex", "flags": "iq"})
    with pytest.raises(ValueError, match=r"regex: option `match` is 'prefix'; use full .* or search"):
        verifier({"kind": "regex", "match": "prefix"})


# ---- format -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("completion", "reason"), [
    ("<think>2+3=5</think>5", "ok"),
    ("\n<think></think> The answer is 5.", "ok"),  # an empty think is a think
    ("5", "bad_format: no <think>"),
    ("Sure! <think>2+3=5</think>5", "bad_format: text before <think>"),
    ("<think>2+3=5", "bad_format: no </think>"),
    ("<think>2+3=5</think>  \n", "bad_format: nothing after </think>"),
    ("<think>a</think><think>b</think>5", "bad_format: more than one <think>"),
    ("<think>a</think>5</think>", "bad_format: more than one </think>"),
])
def test_format_think_answer(completion, reason):
    verdict = verifier("format")(completion, "ignored", MCQ)
    assert (verdict.reward, verdict.reason) == (1.0 if reason == "ok" else 0.0, reason)


def test_format_tags_think_in_prompt_and_the_answer_tag_shape():
    tags = {"kind": "format", "think_open": "<reasoning>", "think_close": "</reasoning>"}
    assert verdict_of(tags, "<reasoning>x</reasoning>5", "")[2] == "ok"
    assert verdict_of(tags, "<think>x</think>5", "")[2] == "bad_format: no <reasoning>"
    opened = {"kind": "format", "think_in_prompt": True}
    assert verdict_of(opened, "2+3=5</think>5", "")[2] == "ok"
    assert verdict_of(opened, "<think>2+3=5</think>5", "")[2] == "bad_format: more than one <think>"
    tagged = {"kind": "format", "shape": "think_answer_tags"}
    assert verdict_of(tagged, "<think>x</think>\n<answer>5</answer>\n", "")[2] == "ok"
    assert verdict_of(tagged, "<think>x</think>5", "")[2] == "bad_format: the answer does not start with <answer>"
    assert verdict_of(tagged, "<think>x</think><answer> </answer>", "")[2] == "bad_format: empty <answer>"
    assert verdict_of(tagged, "<think>x</think><answer>5</answer> more", "")[2].startswith(
        "bad_format: the answer is not one <answer>...</answer>")


def test_format_pattern_is_matched_against_the_whole_response():
    spec = {"kind": "format", "pattern": r"Step \d+:.*\nAnswer: \d+", "flags": "s"}
    assert verdict_of(spec, "Step 1: add\nStep 2: carry\nAnswer: 5", "")[2] == "ok"
    assert verdict_of(spec, "Answer: 5", "")[2] == r"bad_format: the response does not match 'Step \\d+:.*\\nAnswer: \\d+'"


@pytest.mark.parametrize(("options", "message"), [
    ({"shape": "json"}, r"format: option `shape` is 'json'; use one of think_answer, think_answer_tags"),
    ({"shape": "think_answer_tags", "pattern": "x"}, r"format: both `shape` \('think_answer_tags'\) and `pattern`"),
    ({"flags": "s"}, r"format: option `flags` applies to `pattern` only"),
    ({"pattern": "[a-"}, r"format: option `pattern` '\[a-' is not a regular expression"),
    ({"think_open": ""}, r"format: option `think_open` is ''"),
    ({"answer_open": "<think>"}, r"format: the tags .* repeat one"),
])
def test_format_options_are_checked_when_built(options, message):
    with pytest.raises(ValueError, match=message):
        verifier({"kind": "format", **options})


# ---- combined and by name -----------------------------------------------------------------------------------

def test_math_plus_format_as_a_weighted_sum_keeps_both_parts():
    score = verifier({"kind": "sum", "parts": [{"kind": "math", "weight": 0.9}, {"kind": "format", "weight": 0.1}]})
    prompt = Prompt(id="s", prompt="2+3=", ground_truth="5")
    both = score("<think>2+3+0=5;</think>5", "5", prompt)
    assert (both.reward, both.passed, both.reason, both.parts) == (1.0, True, "ok", (("math", 1.0), ("format", 1.0)))
    unformatted = score("5", "5", prompt)
    assert unformatted.reward == pytest.approx(0.9) and unformatted.parts == (("math", 1.0), ("format", 0.0))
    assert (unformatted.passed, unformatted.reason) == (False, "bad_format: no <think>")
    formatted_wrong = score("<think>2+3+0=6;</think>6", "5", prompt)
    assert formatted_wrong.reward == pytest.approx(0.1) and formatted_wrong.reason == "wrong"


def test_each_text_verifier_loads_by_name_and_in_a_route():
    for name in ("choice", "exact", "regex", "format"):
        assert build_verifier(name) is not None and load_reward_fn(name)("B", "B", MCQ).reward in (0.0, 1.0)
    routed = verifier({"route": {"mcq": "choice", "capitals": {"kind": "exact", "case_sensitive": False}}})
    assert routed("The answer is B", "B", MCQ).passed
    assert routed("PARIS", "paris", Prompt(id="c", prompt="Capital of France?", ground_truth="paris",
                                           data_source="capitals")).passed
