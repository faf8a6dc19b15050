"""Damaged files in a run directory end in one error line naming the file and the fix, or, for a damaged
latest checkpoint, in a resume from the newest intact one that says so. Nothing written is deleted."""

import pytest

from flashreinforce.buffer import Ledger
from flashreinforce.cli import main
from flashreinforce.run import run_training
from flashreinforce.run.directory import read_run_config
from flashreinforce.config import load_config
from flashreinforce.models import build_char_tokenizer, build_model
from flashreinforce.trainer.checkpoint import latest_checkpoint, load_states


def _cli_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2  # a ValueError printed as "error: ...", not a traceback
    return capsys.readouterr().err


@pytest.mark.parametrize(("text", "problem"), [
    ("model: {path: [unclosed\n", r"is not valid YAML \(while parsing"),
    ("- just\n- a list\n", r"holds a list, not a mapping of sections"),
    ("", r"holds a NoneType, not a mapping"),
])
def test_a_damaged_run_config_names_the_file_and_the_fix(tmp_path, capsys, text, problem):
    (tmp_path / "config.yaml").write_text(text)
    with pytest.raises(ValueError, match=rf"config\.yaml \(the run's resolved config\) {problem}.*restore it"):
        read_run_config(tmp_path)
    assert "config.yaml (the run's resolved config)" in _cli_error(["train", "--resume", str(tmp_path)], capsys)


def test_eval_of_a_checkpoint_with_damaged_weights_names_the_file(tmp_path, capsys):
    model_dir = tmp_path / "checkpoints" / "step_000001" / "model"
    tokenizer = build_char_tokenizer("0123456789+=", special_tokens=("<pad>", "<eos>", "<unk>"))
    build_model(len(tokenizer), 16, 1, 2, 32).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    error = _cli_error(["eval", str(model_dir.parent), "--recipe", "arithmetic_grpo"], capsys)
    assert f"cannot evaluate {model_dir}: model.safetensors is damaged or truncated" in error
    assert "evaluate an older checkpoint" in error


@pytest.mark.slow  # a whole run, then its resume
def test_resume_skips_a_damaged_latest_checkpoint_and_keeps_it(tiny_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # rich would wrap the long paths of the notes mid-path
    run = tmp_path / "run"
    run_training(load_config(None, [*tiny_run, "log.tensorboard=false"]), run_dir=run)
    damaged = run / "checkpoints" / "step_000003"
    weights = damaged / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    truncated = weights.read_bytes()
    capsys.readouterr()

    main(["train", "--resume", str(run)])  # the run has log.progress=false: a warning is shown anyway
    out = capsys.readouterr().out
    aside = run / "checkpoints" / "step_000003.damaged"
    assert "skipped a damaged checkpoint (model/model.safetensors is damaged or truncated" in out
    assert f"resuming from {run / 'checkpoints' / 'step_000002'}" in out
    assert (aside / "model" / "model.safetensors").read_bytes() == truncated  # kept as it was, not deleted
    _, controller_state, _ = load_states(latest_checkpoint(run / "checkpoints"))
    ledger = Ledger()
    ledger.load_state_dict(controller_state["scheduler"]["ledger"])
    ledger.check()
    assert sorted(ledger.trained().values()) == sorted(s for s in range(3) for _ in range(8))
