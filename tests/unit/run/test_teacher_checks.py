"""A teacher named by path is checked before any work (a pipeline's start, `train --dry-run`): it must be a model
there is, and read the student's token ids; a `stage:` teacher outside a pipeline is refused, naming the fix."""

import pytest

from flashreinforce.config import load_config
from flashreinforce.models import build_model
from flashreinforce.run.distill import resolve_teachers, student_tokenizer
from flashreinforce.run.policy import tiny_tokenizer
from flashreinforce.run.preflight import check_run

PIPELINE = ("stages=[{name: warm, kind: sft, steps: 5}, {name: sums_expert, steps: 2, tasks: {sums: {}}},"
            " {name: merge, kind: distill, from: warm, steps: 2, tasks: {sums: {}, game: {}},"
            " teachers: {sums: {stage: sums_expert}, game: {path: '%s'}}}]")
MIX = ["tasks={sums: {data: {kind: arithmetic, arithmetic: {num_train: 50, num_eval: 8}}},"
       " game: {data: {kind: text_game, text_game: {num_train: 20, num_eval: 4}}, env: {kind: text_game}}}"]


def _model(tmp_path, tokenizer, name="teacher"):
    build_model(len(tokenizer), 16, 1, 2, 32).save_pretrained(tmp_path / name)
    tokenizer.save_pretrained(tmp_path / name)
    return tmp_path / name


def test_a_pipelines_teacher_path_is_checked_against_the_students_tokenizer_before_any_stage(tmp_path):
    config = load_config("arithmetic", [*MIX, PIPELINE % (tmp_path / "teacher")])
    student = student_tokenizer(config)  # the tiny model's: every stage's tasks' characters
    assert student.get_vocab() == tiny_tokenizer(config.stage(0), ["arithmetic", "text_game"]).get_vocab()
    with pytest.raises(ValueError, match=r"stages\[2\] \(merge\): teachers\.game\.path=.*is not a run directory"):
        check_run(config)
    _model(tmp_path, student)
    check_run(config)
    _model(tmp_path, tiny_tokenizer(config.stage(0), ["arithmetic"]))  # the sums task's characters alone
    with pytest.raises(ValueError, match=r"teachers\.game\.path=.*its vocabulary differs from the student's"):
        check_run(config)


def test_a_stage_teacher_outside_a_pipeline_is_refused_naming_the_fix():
    config = load_config("arithmetic", ["algo.loss=opd", "teachers={all: {stage: reason}}"])
    with pytest.raises(ValueError, match=r"teachers\.all\.stage=reason: .*set teachers\.all\.path"):
        resolve_teachers(config, {})
