"""The `ifeval` verifier: each of IFEval's 25 instructions met and not met, how words, sentences and capital
words are counted, strict and loose, the fraction and `all`, the answer after a think, and the ground truth's
errors. Agreement with IFEval's reference checker on generated responses: test_ifeval_reference.py."""

import json

import pytest
from ifeval_cases import BUILDERS, generate

from flashreinforce.types import Prompt
from flashreinforce.verifiers import ifeval
from flashreinforce.verifiers.ifeval import (
    INSTRUCTIONS,
    check_ground_truth,
    count_capital_words,
    count_sentences,
    count_words,
    follows,
    ifeval_verifier,
    parse_ground_truth,
)
from flashreinforce.verifiers.registry import parse_spec, spec_ref
from flashreinforce.verifiers.rewards import load_reward_fn

PROMPT = Prompt(id="p", prompt="Write about rivers.", ground_truth="", data_source="ifeval")


def truth(*constraints) -> str:
    """Ground truth JSON from (instruction id, kwargs) pairs."""
    return json.dumps({"instruction_id_list": [i for i, _ in constraints], "kwargs": [k for _, k in constraints]})


def met(instruction_id: str, kwargs: dict, response: str, *, strict: bool = True) -> bool:
    ((_, args),) = parse_ground_truth(truth((instruction_id, kwargs)))
    return follows(response, instruction_id, args, strict=strict)


# (instruction id, kwargs, a response that meets it, one that does not)
CASES = [
    ("keywords:existence", {"keywords": ["river", "stone"]}, "A RIVER of stones.", "A river of sand."),
    ("keywords:frequency", {"keyword": "war", "frequency": 2, "relation": "at least"}, "War and a warm toward.",
     "War and peace."),
    ("keywords:frequency", {"keyword": "war", "frequency": 2, "relation": "less than"}, "War and peace.",
     "war, war."),
    ("keywords:forbidden_words", {"forbidden_words": ["rock"]}, "Rocks and rocky hills.", "We ROCK."),
    ("keywords:letter_frequency", {"letter": "t", "let_frequency": 2, "let_relation": "less than"}, "A cat.",
     "A Tall cat."),
    ("keywords:letter_frequency", {"letter": "o", "let_frequency": 3, "let_relation": "at least"}, "Oh, no, so.",
     "Oh no."),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "less than"}, "One. Two!",
     "One. Two? Three."),
    ("length_constraints:number_sentences", {"num_sentences": 2, "relation": "at least"}, "Hi. Dr. Who came.",
     "Dr. Who came."),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "One.\n***\nTwo.", "One.\n***\n***\nTwo."),
    ("length_constraints:number_words", {"num_words": 4, "relation": "at least"}, "It's 3.5 km.", "It is km."),
    ("length_constraints:number_words", {"num_words": 4, "relation": "less than"}, "It is km.", "It's 3.5 km."),
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "Then"},
     'First.\n\n"Then, we left.', "First.\n\nAnd then.\n\nMore."),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "Dear [name] at [address].",
     "Dear [name] at [ad\ndress]."),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi.\n\np. s. bye", "Hi.\n\nPS bye"),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Hi.\nP. P. S bye", "Hi.\nP.S. bye"),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "Items:\n* one\n- two", "* one\n**bold**\n"),
    ("detectable_format:constrained_response", {}, "Well. My answer is maybe.", "My answer is Maybe."),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and **two**",
     "*one* and * * and **"),
    ("detectable_format:multiple_sections", {"section_spliter": "SECTION", "num_sections": 2},
     "SECTION 1\na\nSECTION 2\nb", "SECTION 1\na\nSection 2\nb"),
    ("detectable_format:json_format", {}, '```json\n{"a": [1, 2]}\n```', '{"a": 1} and more'),
    ("detectable_format:title", {}, "<<My Title>>\nText.", "<< >>\nText."),
    ("combination:two_responses", {}, "First.\n******\nSecond.", "Same.\n******\nSame."),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a poem."}, "write a POEM. Roses...", "Sure! Write a poem."),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, '"Done. Any other questions?"',
     "Any other questions? Bye."),
    ("change_case:capital_word_frequency", {"capital_frequency": 3, "capital_relation": "at least"}, "DON'T GO.",
     "Don't GO."),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": "less than"}, "Only NASA.",
     "AT&T."),
    ("punctuation:no_comma", {}, "No commas here.", "Yes, one."),
    ("startend:quotation", {}, '  "Wrapped."\n', '"Half.'),
]
LANGUAGE_CASES = [
    ("language:response_language", {"language": "fr"}, "Le temps est magnifique aujourd'hui et nous allons au parc.",
     "The weather is lovely today and we are going to the park."),
    ("language:response_language", {"language": "hi"}, "आज मौसम बहुत अच्छा है और हम पार्क जा रहे हैं।",
     "Сегодня прекрасная погода, и мы идём в парк."),
    ("change_case:english_capital", {}, "THE WEATHER IS LOVELY TODAY AND WE ARE GOING TO THE PARK.",
     "LE TEMPS EST MAGNIFIQUE AUJOURD'HUI ET NOUS ALLONS AU PARC."),
    ("change_case:english_lowercase", {}, "the weather is lovely today and we are going to the park.",
     "the weather is lovely today and we are going to the Park."),
]


def test_the_table_covers_all_25_instruction_ids():
    assert len(INSTRUCTIONS) == 25
    assert {case[0] for case in CASES + LANGUAGE_CASES} == set(INSTRUCTIONS)


@pytest.mark.parametrize(("instruction_id", "kwargs", "good", "bad"), CASES, ids=[c[0] for c in CASES])
def test_each_instruction_is_met_by_one_response_and_not_the_other(instruction_id, kwargs, good, bad):
    assert met(instruction_id, kwargs, good)
    assert not met(instruction_id, kwargs, bad)


@pytest.mark.ifeval
@pytest.mark.parametrize(("instruction_id", "kwargs", "good", "bad"), LANGUAGE_CASES, ids=[c[0] for c in LANGUAGE_CASES])
def test_each_language_instruction_is_met_by_one_response_and_not_the_other(instruction_id, kwargs, good, bad):
    assert met(instruction_id, kwargs, good)
    assert not met(instruction_id, kwargs, bad)


@pytest.mark.ifeval
def test_language_detection_is_a_function_of_the_text_and_a_text_without_letters_counts_as_met():
    text = "Ciao, come stai oggi? Bene."
    assert len({ifeval.detect_language(text) for _ in range(5)}) == 1
    assert met("language:response_language", {"language": "ko"}, "12345 !!!")  # nothing to judge: met (IFEval)
    chinese = "今天天气很好，我们和朋友一起去公园散步。"
    assert met("language:response_language", {"language": "zh"}, chinese)  # langdetect says zh-cn or zh-tw


def test_words_are_runs_of_word_characters_marks_included():
    assert count_words("It's 3.5 km.") == 5
    assert count_words("snake_case e-mail") == 3
    assert count_words("आज मौसम बहुत अच्छा है।") == 5  # the vowel signs belong to their words
    assert count_words("x² ½") == 1
    assert count_words("") == 0


@pytest.mark.parametrize(("text", "sentences"), [
    ("", 0), ("No mark at all", 1), ("One. Two! Three? Four", 4), ("Hi. ok then.", 2),
    ("* one\n* two\n* three", 1), ("Wow!!! Yes.", 2), ('She said "Hello." Then she left.', 2),
    ("(This is an aside.) Next one.", 2), ("Dr. Smith came at 5 p.m. and left.", 1),
    ("We left at 5 p.m. The talk began.", 2), ("Use fruit, e.g. apples.", 2), ("It was late... we went home.", 1),
    ("It cost 3.5 dollars.", 1), ("1. First\n2. Second", 3), ("In 2020. then more", 1), ("P.S. See you.", 2),
    ("J. K. Rowling wrote.", 1), ("Outline: I. Introduction", 2), ("The U.S. economy grew.", 1),
    ("Washington D.C. is big.", 1), ("Really?! No.", 2), ('"Why not?" he asked.', 2), ("wait . . . then go.", 4),
])
def test_sentences_end_where_the_documented_rules_say(text, sentences):
    assert count_sentences(text) == sentences


@pytest.mark.parametrize(("text", "capitals"), [
    ("HELLO world", 1), ("I am OK.", 2), ("DON'T", 2), ("AT&T and Q&A", 4), ("CANNOT", 2), ("U.S.", 1),
    ("COVID-19", 1), ("ROCK-SOLID I/O O'NEIL", 3), ("IT\u2019S", 2), ("NASA's", 1), ("A,B", 2), ("DON'T.", 2),
    ("wanna GONNA", 2), ("123 !!", 0),
])
def test_capital_words_are_counted_as_ifeval_tokenizes(text, capitals):
    assert count_capital_words(text) == capitals


def test_thresholds_of_zero_are_kept():
    assert met("detectable_content:number_placeholders", {"num_placeholders": 0}, "no brackets")
    assert not met("keywords:frequency", {"keyword": "a", "frequency": 0, "relation": "less than"}, "b")


def test_keywords_and_markers_are_literal_text_and_a_non_letter_letter_is_counted():
    assert met("keywords:existence", {"keywords": ["c++"]}, "I write C++ daily.")
    assert not met("keywords:existence", {"keywords": ["c.t"]}, "a cat")
    assert met("keywords:letter_frequency", {"letter": "#", "let_frequency": 2, "let_relation": "at least"}, "#a #b")
    assert met("detectable_format:multiple_sections", {"section_spliter": "Day+", "num_sections": 1}, "Day+ 1 x")


def test_loose_mode_also_tries_without_the_first_or_last_line_and_without_stars():
    quoted = 'Sure, here it is:\n"Wrapped."'
    assert not met("startend:quotation", {}, quoted) and met("startend:quotation", {}, quoted, strict=False)
    ending = "Text. Is that all?\nHope this helps!"
    kwargs = {"end_phrase": "Is that all?"}
    assert not met("startend:end_checker", kwargs, ending) and met("startend:end_checker", kwargs, ending, strict=False)
    starred = '**"Wrapped."**'
    assert not met("startend:quotation", {}, starred) and met("startend:quotation", {}, starred, strict=False)
    assert not met("punctuation:no_comma", {}, "a, b\nc, d\ne, f", strict=False)  # a middle line stays


def test_an_empty_answer_meets_nothing():
    assert not met("punctuation:no_comma", {}, "   ")
    assert not met("keywords:forbidden_words", {"forbidden_words": ["x"]}, "", strict=False)


GT = truth(("punctuation:no_comma", {}), ("keywords:existence", {"keywords": ["river"]}),
           ("startend:quotation", {}))


def test_the_reward_is_the_fraction_met_or_all_met_and_the_reason_names_the_first_failure():
    verdict = ifeval_verifier()("A river, wide.", GT, PROMPT)
    assert (verdict.reward, verdict.passed, verdict.reason) == (pytest.approx(1 / 3), False,
                                                                "failed: punctuation:no_comma")
    assert ifeval_verifier(all=True)("A river, wide.", GT, PROMPT).reward == 0.0
    verdict = ifeval_verifier(all=True)('"A river wide."', GT, PROMPT)
    assert (verdict.reward, verdict.passed, verdict.reason) == (1.0, True, "ok")


def test_only_the_answer_after_the_think_counts():
    score = ifeval_verifier()
    assert score('<think>no "quotes", here</think>\n\n"A river wide."', GT, PROMPT).passed
    assert score('<think>still "thinking, river', GT, PROMPT).reason == "no_answer"
    first = truth(("length_constraints:nth_paragraph_first_word",
                   {"num_paragraphs": 2, "nth_paragraph": 1, "first_word": "rivers"}))
    assert score("<think>plan</think>\n\nRivers flow.\n\nThey end.", first, PROMPT).passed  # template's \n\n dropped


def test_the_registry_builds_it_from_a_spec_as_the_pool_does():
    ref = spec_ref(parse_spec({"kind": "ifeval", "all": True, "strict": False}))
    score = load_reward_fn(ref)
    assert score('Here:\n"A river wide."', GT, PROMPT).passed  # loose: the first line goes
    assert load_reward_fn("ifeval")('Here:\n"A river wide."', GT, PROMPT).reason == "failed: startend:quotation"
    with pytest.raises(ValueError, match="ifeval has no option 'strict_mode'; its options: all, strict"):
        load_reward_fn(spec_ref(parse_spec({"kind": "ifeval", "strict_mode": True})))
    with pytest.raises(ValueError, match="options all and strict are true or false"):
        ifeval_verifier(all="yes")


def test_hugging_face_rows_with_every_kwarg_null_but_its_own_are_read():
    row = {"instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"],
           "kwargs": [{"num_words": None, "relation": None, "keywords": None},
                      {"num_words": 3.0, "relation": "less than", "keywords": None}]}
    assert parse_ground_truth(json.dumps(row))[1][1] == {"num_words": 3, "relation": "less than"}
    check_ground_truth(json.dumps(row))
    check_ground_truth(row)  # an already-parsed record too


@pytest.mark.parametrize(("ground_truth", "message"), [
    ("not json", r"ifeval ground truth is not JSON .* give \{\"instruction_id_list\""),
    ('{"kwargs": []}', "lacks instruction_id_list or kwargs"),
    ('{"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}], "extra": 1}', "has 'extra'"),
    ('{"instruction_id_list": [], "kwargs": []}', "must be a non-empty list"),
    ('{"instruction_id_list": ["punctuation:no_comma"], "kwargs": []}',
     r"1 instruction ids but 0 kwargs entries; give a list with one kwargs object per id"),
    ('{"instruction_id_list": ["punctuation:no_coma"], "kwargs": [{}]}',
     r"unknown instruction id 'punctuation:no_coma' \(instruction_id_list\[0\]\); the known ones: "
     r"keywords:existence, .*punctuation:no_comma"),
    ('{"instruction_id_list": ["length_constraints:number_words"], "kwargs": [{"num_words": 5}]}',
     r"kwargs\[0\] \(length_constraints:number_words\) lacks 'relation'; length_constraints:number_words takes "
     r"num_words \(an integer >= 0\), relation \(\"less than\" or \"at least\"\)"),
    ('{"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{"num_words": 5}]}',
     r"has 'num_words', which punctuation:no_comma does not take \(it takes no kwargs\); remove it or set it to null"),
    ('{"instruction_id_list": ["keywords:frequency"], "kwargs": [{"keyword": "a", "frequency": 2, '
     '"relation": "more than"}]}', r"relation must be \"less than\" or \"at least\", got 'more than'"),
    ('{"instruction_id_list": ["keywords:letter_frequency"], "kwargs": [{"letter": "ab", "let_frequency": 2, '
     '"let_relation": "at least"}]}', "letter must be one character, got 'ab'"),
    ('{"instruction_id_list": ["length_constraints:nth_paragraph_first_word"], "kwargs": [{"num_paragraphs": 2, '
     '"nth_paragraph": 3, "first_word": "a"}]}', "nth_paragraph must be between 1 and num_paragraphs"),
    ('{"instruction_id_list": ["language:response_language"], "kwargs": [{"language": "xx"}]}',
     "language must be an ISO 639-1 code langdetect knows"),
    ('{"instruction_id_list": ["keywords:existence"], "kwargs": [{"keywords": "river"}]}',
     "keywords must be a non-empty list of non-empty strings"),
])
def test_bad_ground_truth_names_the_problem_and_the_fix(ground_truth, message):
    with pytest.raises(ValueError, match=message):
        check_ground_truth(ground_truth)
    with pytest.raises(ValueError, match=message):
        ifeval_verifier()("answer", ground_truth, PROMPT)


def test_a_row_that_detects_language_without_the_extra_names_the_extra(monkeypatch):
    monkeypatch.setattr(ifeval, "has_langdetect", lambda: False)
    row = truth(("change_case:english_lowercase", {}))
    with pytest.raises(ValueError, match=r"change_case:english_lowercase detects the response's language, which "
                                         r"needs langdetect: pip install -e '.\[ifeval\]'"):
        check_ground_truth(row)
    with pytest.raises(ValueError, match=r"pip install -e '.\[ifeval\]'"):
        ifeval_verifier()("all lowercase here", row, PROMPT)
    check_ground_truth(truth(("punctuation:no_comma", {})))  # rows that do not detect language need nothing


def test_the_reference_tests_cases_cover_every_instruction_with_valid_ground_truths():
    cases = generate(seed=0)
    assert set(BUILDERS) == set(INSTRUCTIONS) == {case.instruction_id_list[0] for case in cases}
    for case in cases:  # parsed, not checked: without the ifeval extra the language rows would be refused
        parse_ground_truth({"instruction_id_list": list(case.instruction_id_list), "kwargs": list(case.kwargs)})
    assert generate(seed=0) == cases  # a seed gives the same cases
