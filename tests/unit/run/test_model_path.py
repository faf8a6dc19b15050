"""A known model's name resolves to its converted directory through one lookup, for `model.path` and for
`flashreinforce models path`: the same directory, and the same error naming the command that converts it."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashreinforce.run.models import model_path
from flashreinforce.run.policy import resolve_model_path

NAME = "smollm2-135m-instruct"


def test_model_path_and_the_models_command_share_one_lookup_and_one_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHREINFORCE_CACHE", str(tmp_path))
    with pytest.raises(ValueError) as command:
        model_path(NAME, None)
    assert str(command.value) == f"{tmp_path / 'models' / NAME} is not there; run `flashreinforce models get {NAME}`"
    with pytest.raises(ValueError) as config:
        resolve_model_path(NAME)
    assert str(config.value) == f"model.path={NAME}: {command.value}"


def test_a_directory_or_an_unknown_name_is_taken_as_a_path(tmp_path):
    assert resolve_model_path(str(tmp_path)) == tmp_path
    assert resolve_model_path("no/such/model") == Path("no/such/model")
