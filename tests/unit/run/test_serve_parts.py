"""run/serve.py: which model `flashreinforce serve PATH` serves, and in which precision (the serving itself runs
in tests/integration/test_serve.py)."""

import pytest

from flashreinforce.run.serve import ServeRequest, served_model


def test_a_run_is_served_from_its_latest_model_in_its_rollout_precision(save_chat_model, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    model_dir = save_chat_model(32, 1)
    (run_dir / "checkpoints" / "step_000002" / "model").symlink_to(model_dir)
    (run_dir / "config.yaml").write_text("precision: {trainer: bf16, rollout: bf16}\n")
    assert served_model(ServeRequest(str(run_dir))) == (run_dir / "checkpoints" / "step_000002" / "model", "bf16")
    assert served_model(ServeRequest(str(run_dir), precision="fp32"))[1] == "fp32"
    assert served_model(ServeRequest(str(model_dir))) == (model_dir, "fp32")  # outside a run


def test_a_path_that_holds_no_model_is_refused_naming_what_it_takes(tmp_path):
    with pytest.raises(ValueError, match="not a run directory, a checkpoint directory or a Hugging Face model"):
        served_model(ServeRequest(str(tmp_path)))
    with pytest.raises(ValueError, match="no such directory, and no model by that name"):
        served_model(ServeRequest("no-such-model"))


def test_a_known_model_not_converted_yet_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHREINFORCE_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="flashreinforce models get smollm2-135m-instruct"):
        served_model(ServeRequest("smollm2-135m-instruct"))
