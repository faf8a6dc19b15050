"""`flashreinforce config`: every field with its type, default and doc, and docs/config.md generated from it."""

from pathlib import Path

import pytest

from flashreinforce.cli import main
from flashreinforce.run.config_reference import as_markdown, field_docs, select

DOCS = Path(__file__).resolve().parents[3] / "docs" / "config.md"


def test_docs_config_md_is_what_config_py_generates():
    assert DOCS.read_text() == as_markdown(list(field_docs())), \
        "docs/config.md is out of date: flashreinforce config --markdown > docs/config.md"


def test_every_field_is_documented_with_its_type_and_default():
    docs = {d.name: d for d in field_docs()}
    assert [name for name, d in docs.items() if not d.doc] == []
    assert (docs["trainer.lr"].type, docs["trainer.lr"].default) == ("float, > 0", "0.0003")
    assert docs["precision.trainer"].type == "fp32 | bf16 | fp8"
    # an optional section is a field of its own (off by default) and lists its fields, required ones marked
    assert (docs["algo.hints"].type, docs["algo.hints"].default) == ("HintConfig | None", "None")
    assert docs["algo.hints.p_initial"].default == "required"
    assert "trainer" not in docs and "trainer.steps" in docs  # a section with a default is only a heading


def test_the_command_prints_a_section_or_a_field_and_names_the_sections_for_an_unknown_one(capsys):
    main(["config", "algo.hints"])
    out = capsys.readouterr().out
    assert out.startswith("algo.hints: HintConfig | None = None\n    Adaptive hint-based RL")
    assert "algo.hints.gamma: float, >= 0 = required" in out and "algo.loss" not in out
    with pytest.raises(SystemExit):
        main(["config", "trainer.lrr"])
    assert "no config field or section 'trainer.lrr'; sections: model, precision" in capsys.readouterr().err
    assert [d.name for d in select(list(field_docs()), "seed")] == ["seed"]
