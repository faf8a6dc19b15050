"""The trainer's teachers (algo.loss=opd): each task's frozen model, loaded where the trainer runs (its process, a
data-parallel rank, a Ray actor), each distinct directory and precision once, and checked against the student's
tokenizer before any work.

A teacher scores the student's token ids, so it must read them as the same tokens: its vocabulary is the student's,
or holds every student token under the same id with the same chat template (a larger vocabulary of the same
family: the extra tokens are never sampled). Anything else is refused here, naming the first token that differs.
Where a teacher's directory comes from (a stage, a run, the Hub): run/distill.py, before the trainer is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flashreinforce.algorithms.losses import LOSSES
from flashreinforce.config import RunConfig, TeacherConfig
from flashreinforce.models import load_model
from flashreinforce.models.causal_lm import check_model_dir, disable_dropout
from flashreinforce.models.tokenizer import load_tokenizer
from flashreinforce.trainer.teachers import Teachers

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_teachers(config: RunConfig, tokenizer: Any) -> Teachers | None:
    """Each task's teacher, frozen, from its (already resolved) directory; None when the loss uses none."""
    if not LOSSES[config.algo.loss].needs_teacher:
        return None
    teachers, loaded = config.teachers or {}, {}
    by_task = {}
    for task, _ in config.task_list():
        name = task if task in teachers else "all"
        teacher = teachers[name]
        key = (teacher.path, teacher.precision)
        if key not in loaded:
            loaded[key] = load_teacher(teacher, tokenizer, field=f"teachers.{name}")
        by_task[task] = loaded[key]
    return Teachers(by_task)


def load_teacher(teacher: TeacherConfig, student_tokenizer: Any, *, field: str) -> torch.nn.Module:
    """One teacher in its precision, after its tokenizer is checked against the student's."""
    if teacher.path is None:
        raise ValueError(f"{field}.stage={teacher.stage}: a stage's model is a teacher only inside a pipeline (a stage "
                         f"of `stages:` after it); in a run of its own, set {field}.path to a model or a run directory")
    path = check_model_dir(teacher.path, field=f"{field}.path")
    check_vocabulary(student_tokenizer, path, field=f"{field}.path={teacher.path}")
    # Loaded in fp32 and cast, as the trainer casts the student: a bf16 teacher equal to a bf16 student then
    # computes exactly as the student does (buffers such as RoPE's frequencies included) and teaches nothing.
    model = load_model(path, dtype=torch.float32).to(PRECISIONS[teacher.precision])
    disable_dropout(model)
    return model


def check_vocabulary(student: Any, directory: Path, *, field: str) -> None:
    """The tokenizer in `directory` reads the student's token ids as the student does, or a ValueError after
    `field`."""
    problem = vocabulary_problem(student, load_tokenizer(directory))
    if problem is not None:
        raise ValueError(f"{field}: {problem}; a teacher scores the student's token ids, so it must share the "
                         "student's tokenizer (a same-family model whose ids map exactly)")


def vocabulary_problem(student: Any, teacher: Any) -> str | None:
    """What keeps `teacher` from scoring `student`'s ids, or None: the same vocabulary; or every student token under
    the same id in the teacher's, with the same chat template."""
    own, theirs = student.get_vocab(), teacher.get_vocab()
    if own == theirs:
        return None
    differing = sorted((index, token) for token, index in own.items() if theirs.get(token) != index)
    if differing:
        index, token = differing[0]
        where = f"has id {theirs[token]} there" if token in theirs else "is not in it"
        return (f"its vocabulary differs from the student's ({len(theirs)} vs {len(own)} tokens, {len(differing)} of "
                f"the student's under another id or missing; the first, {token!r} (id {index}), {where})")
    if student.chat_template != teacher.chat_template:
        return (f"its vocabulary holds the student's tokens under the same ids and {len(theirs) - len(own)} more, but "
                "its chat template differs from the student's (a larger vocabulary is taken only from the same "
                "family: the same chat template)")
    return None
