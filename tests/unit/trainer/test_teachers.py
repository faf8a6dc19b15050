"""Teachers in the trainer (algo.loss=opd): a teacher-scored batch carries each row's teacher's own full-forward
log-probs (microbatched, trimmed, several teachers in one batch); a teacher equal to the student teaches nothing;
the step descends the reverse KL it reports, per task; and teachers that cannot score the student's ids are
refused when they load."""

import copy

import pytest
import torch

from flashreinforce.config import TeacherConfig
from flashreinforce.models import build_char_tokenizer, build_model
from flashreinforce.models.tokenizer import load_tokenizer
from flashreinforce.run.teachers import load_teacher, vocabulary_problem
from flashreinforce.trainer.batching import collate
from flashreinforce.trainer.teachers import Teachers
from flashreinforce.trainer.trainer import OptimizerSettings, Trainer
from flashreinforce.types import FORCED_VERSION, Prompt, RolloutKey, Trajectory, Verdict

VOCAB, TEMPERATURE = 12, 0.7


def _rows(count: int = 9, seed: int = 0, shortest: int = 4) -> list[Trajectory]:
    """Rows of lengths shortest..shortest+7 with prompts of 2-3 tokens, alternating tasks a and b (behavior
    log-probs are made up: the loss tests do not read them here)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for row in range(count):
        length, prompt = shortest + row % 8, 2 + row % 2
        tokens = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        mask = tuple(int(i >= prompt) for i in range(length))
        task = "ab"[row % 2]
        rows.append(Trajectory(
            key=RolloutKey(f"{task}/p{row}", 0), prompt=Prompt(id=f"{task}/p{row}", prompt="x", ground_truth="1",
                                                               task=task),
            group=row, tokens=tuple(tokens), loss_mask=mask, behavior_logprobs=tuple(-1.0 * m for m in mask),
            policy_versions=tuple(0 if m else FORCED_VERSION for m in mask), prompt_length=prompt,
            finish_reason="stop", verdict=Verdict(reward=float(row % 3 == 0), passed=row % 3 == 0)))
    return rows


def _trainer(model, teachers, *, minibatches=1, microbatch_size=3, lr=1e-2, pack=False):
    return Trainer(model, loss="opd", loss_options={},
                   optimizer=OptimizerSettings(lr=lr, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=0,
                                               total_steps=10, min_lr_ratio=1.0, grad_clip=1e9),
                   microbatch_size=microbatch_size, microbatch_tokens=24, pad_token_id=0, temperature=TEMPERATURE,
                   max_new_tokens=16, minibatches=minibatches, teachers=teachers, pack=pack)


def _own_forward(model, tokens) -> torch.Tensor:
    """The teacher's own full forward of one row: log softmax(z / T) of every next token, no padding, no trimming."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float() / TEMPERATURE
    return torch.cat([torch.zeros(1), logits[:-1].log_softmax(-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]])


@pytest.mark.parametrize("pack", [False, True])
def test_a_teacher_scored_batch_is_each_teachers_own_full_forward(pack):
    """Two teachers (task a's, task b's) score a batch cut into mini-batches and token-budget microbatches (padded,
    or packed: trainer.pack): every row's loss tokens get its own teacher's full-forward log-probs to 1e-5 (fp32)."""
    student = build_model(VOCAB, 16, 1, 2, 32, seed=1)
    teacher_a, teacher_b = build_model(VOCAB, 24, 2, 2, 32, seed=2), build_model(VOCAB, 16, 1, 2, 32, seed=3)
    trainer = _trainer(student, Teachers({"a": teacher_a, "b": teacher_b}), minibatches=2, pack=pack)
    assert trainer.pack == pack
    rows = sorted(_rows(), key=lambda t: len(t.tokens))
    batch = collate(rows, 0)
    splits = [trainer._own_microbatches(batch, part) for part in
              (torch.arange(0, 5), torch.arange(5, len(rows)))]
    assert sum(len(part) for part in splits) > 2, "the batch must be cut into several microbatches"
    scores = trainer._targets(batch, rows, rows, splits).teacher_logprobs
    for index, row in enumerate(rows):
        own = _own_forward(teacher_a if row.prompt.task == "a" else teacher_b, list(row.tokens))
        mask = torch.tensor(row.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(scores[index, : len(row.tokens)][mask], own[mask], rtol=0, atol=1e-5)


def test_a_teacher_equal_to_the_student_teaches_nothing():
    student = build_model(VOCAB, 16, 1, 2, 32, seed=1)
    trainer = _trainer(student, Teachers({"a": copy.deepcopy(student), "b": copy.deepcopy(student)}))
    before = copy.deepcopy(student.state_dict())
    metrics = trainer.step(_rows())
    assert metrics["loss/reverse_kl"] == 0.0 and metrics["task/a/reverse_kl"] == 0.0
    assert all(torch.equal(before[name], value) for name, value in student.state_dict().items())


def test_the_step_reports_and_descends_the_reverse_kl_to_each_tasks_teacher():
    """loss/reverse_kl is mean(log pi_S - log pi_T) over the batch's loss tokens (full forwards of both models),
    task/<name>/reverse_kl each task's; steps on these fixed rows bring each token's log-prob toward its teacher's
    (the gradient is that of the squared gap, test_distill.py)."""
    student = build_model(VOCAB, 16, 1, 2, 32, seed=1)
    teachers = {"a": build_model(VOCAB, 16, 1, 2, 32, seed=2), "b": build_model(VOCAB, 16, 1, 2, 32, seed=3)}
    for teacher in teachers.values():  # sharper than a random init: the student has something to learn
        with torch.no_grad():
            teacher.model.norm.weight.mul_(4)
    rows = _rows()

    def gaps() -> dict[str, torch.Tensor]:
        by_task = {"a": [], "b": []}
        for row in rows:
            mask = torch.tensor(row.loss_mask, dtype=torch.bool)
            gap = _own_forward(student, list(row.tokens)) - _own_forward(teachers[row.prompt.task], list(row.tokens))
            by_task[row.prompt.task].append(gap[mask])
        return {task: torch.cat(chunks) for task, chunks in by_task.items()}
    before = gaps()
    trainer = _trainer(student, Teachers(teachers), lr=3e-2)
    metrics = trainer.step(rows)
    assert metrics["loss/reverse_kl"] == pytest.approx(float(torch.cat([before["a"], before["b"]]).mean()), abs=1e-5)
    for task in "ab":
        assert metrics[f"task/{task}/reverse_kl"] == pytest.approx(float(before[task].mean()), abs=1e-5)
    assert metrics["time/teacher_seconds"] > 0
    for _ in range(8):
        trainer.step(rows)
    after = gaps()
    for task in "ab":
        assert float((after[task] ** 2).mean()) < 0.25 * float((before[task] ** 2).mean())


def test_the_trainer_refuses_opd_without_teachers_and_teachers_without_opd():
    model = build_model(VOCAB, 16, 1, 2, 32, seed=1)
    with pytest.raises(ValueError, match="teachers"):
        _trainer(model, None)
    with pytest.raises(ValueError, match="does not use them"):
        Trainer(model, loss="grpo", loss_options={}, optimizer=OptimizerSettings(1e-3, 0.0, (0.9, 0.999), 0, 1, 1.0,
                                                                                 1.0),
                microbatch_size=2, pad_token_id=0, temperature=1.0, max_new_tokens=8,
                teachers=Teachers({"": copy.deepcopy(model)}))


def _saved(tmp_path, name, alphabet, chat_template=None, extra=()):
    tokenizer = build_char_tokenizer(alphabet, special_tokens=("<pad>", "<eos>", "<unk>", *extra))
    tokenizer.chat_template = chat_template
    model = build_model(len(tokenizer), 16, 1, 2, 32, seed=1)
    directory = tmp_path / name
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, tokenizer


def test_a_teacher_with_another_vocabulary_is_refused_when_it_loads(tmp_path):
    _student_dir, student = _saved(tmp_path, "student", "0123456789+=")
    same, _ = _saved(tmp_path, "same", "0123456789+=")
    assert vocabulary_problem(student, load_tokenizer(same)) is None
    model = load_teacher(TeacherConfig(path=str(same), precision="bf16"), student, field="teachers.all")
    assert next(model.parameters()).dtype == torch.bfloat16
    shuffled, _ = _saved(tmp_path, "shuffled", "0123456789=+")
    with pytest.raises(ValueError, match=r"teachers\.sums\.path=.*'\+' \(id 13\), has id 14 there"):
        load_teacher(TeacherConfig(path=str(shuffled)), student, field="teachers.sums")
    # A larger vocabulary whose ids map exactly is taken with the same chat template, refused with another.
    larger, _ = _saved(tmp_path, "larger", "0123456789+=-")
    assert vocabulary_problem(student, load_tokenizer(larger)) is None
    templated, _ = _saved(tmp_path, "templated", "0123456789+=-", chat_template="{{ messages }}")
    assert "chat template" in vocabulary_problem(student, load_tokenizer(templated))
    with pytest.raises(ValueError, match=r"teachers\.all\.path .*missing. does not exist"):
        load_teacher(TeacherConfig(path=str(tmp_path / "missing")), student, field="teachers.all")
    with pytest.raises(ValueError, match="only inside a pipeline"):
        load_teacher(TeacherConfig(stage="reason"), student, field="teachers.all")


def test_a_bf16_teacher_equal_to_a_bf16_student_teaches_nothing(tmp_path):
    """The teacher is cast to its precision as the trainer casts the student, buffers included (a Llama loaded
    straight in bf16 keeps RoPE's frequencies in fp32, the cast student has them in bf16: 2e-3 apart at 60
    tokens), so the same model in bf16 on both sides gives a signal of exactly 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flashreinforce.models import load_model
    from flashreinforce.models.numerics import Numerics

    directory, tokenizer = _saved(tmp_path, "model", "0123456789+=")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=128)).save_pretrained(directory)
    teacher = load_teacher(TeacherConfig(path=str(directory), precision="bf16"), tokenizer, field="teachers.all")
    trainer = Trainer(load_model(directory), loss="opd", loss_options={},
                      optimizer=OptimizerSettings(1e-2, 0.0, (0.9, 0.999), 0, 10, 1.0, 1e9), microbatch_size=4,
                      pad_token_id=0, temperature=TEMPERATURE, max_new_tokens=80, numerics=Numerics("bf16"),
                      teachers=Teachers({"a": teacher, "b": teacher}))
    metrics = trainer.step(_rows(shortest=56))
    assert metrics["loss/reverse_kl"] == 0.0 and metrics["optim/grad_norm"] == 0.0


def test_each_distinct_teacher_is_loaded_once(tmp_path):
    """MOPD over the multitask recipe's four tasks: sums has its own teacher, the others share `all`'s."""
    from flashreinforce.config import load_config
    from flashreinforce.run.teachers import load_teachers

    shared, tokenizer = _saved(tmp_path, "shared", "0123456789+=")
    own, _ = _saved(tmp_path, "own", "0123456789+=")
    config = load_config("multitask", ["algo.loss=opd", f"teachers={{all: {{path: {shared}}}, sums: {{path: {own}}}}}"])
    teachers = load_teachers(config, tokenizer)
    assert list(teachers.by_task) == ["sums", "tool", "follow", "most"] and len(teachers.models) == 2
    assert teachers.by_task["tool"] is teachers.by_task["most"] is not teachers.by_task["sums"]
    assert load_teachers(load_config("multitask"), tokenizer) is None  # a loss without teachers loads none
