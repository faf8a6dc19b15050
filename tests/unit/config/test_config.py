import math

import pytest

from flashreinforce.cli import main
from flashreinforce.config import RECIPES_DIR, load_config, parse_override

SHIPPED = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def test_ships_the_recipes_the_issue_names():
    assert {"arithmetic", "arithmetic_grpo", "arithmetic_sync", "arithmetic_april", "arithmetic_urb", "r1",
            "qwen_math", "qwen7b_tool", "qwen3_tool_ablation", "alfworld"} <= set(SHIPPED)


USER_FIELDS = {"own_model": ["model.path=org/name", "data.train=train.jsonl", "data.eval=test.jsonl"]}
"""Recipes that leave the model and data to the user: without them they stop naming the fields."""


@pytest.mark.parametrize("recipe", SHIPPED)
def test_every_shipped_recipe_parses_and_dry_runs(recipe, capsys):
    if recipe in USER_FIELDS:
        with pytest.raises(ValueError, match=r"data.train=\.\.\., data.eval=\.\.\."):
            load_config(recipe)
    config = load_config(recipe, USER_FIELDS.get(recipe, []))
    assert config.name == recipe
    main(["train", recipe, *USER_FIELDS.get(recipe, []), "--dry-run"])
    printed = capsys.readouterr().out
    assert f"name: {recipe}" in printed and "scheduler:" in printed


def test_overrides_reach_nested_fields():
    config = load_config(None, ["trainer.lr=1e-5", "scheduler.kind=urb", "algo.options.delta=inf"])
    assert config.trainer.lr == 1e-5
    assert config.scheduler.kind == "urb"
    assert math.isinf(config.algo.options["delta"])


def test_inherited_recipe_keeps_parent_fields_and_overrides_its_own():
    child = load_config("arithmetic_grpo")
    parent = load_config("arithmetic")
    assert child.algo.loss == "grpo" and child.scheduler.group_size == 4
    assert child.trainer == parent.trainer and child.sft == parent.sft


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["trainer.lrr=1"], "trainer.lrr"),
        (["scheduler.kind=fifo"], "scheduler.kind"),
        (["trainer.lr=-1"], "trainer.lr"),
        (["model.tiny.hidden_size=130"], "hidden_size"),
        (["algo.loss=grpo"], "group_size"),
        (["data.kind=files"], "train"),
        (["algo.dynamic_sampling=true"], "algo.dynamic_sampling=true .* scheduler.group_size=1"),
    ],
)
def test_config_errors_name_the_field(overrides, names):
    with pytest.raises(ValueError, match=names):
        load_config(None, overrides)


def test_unknown_recipe_lists_the_shipped_ones():
    with pytest.raises(ValueError, match="arithmetic_urb"):
        load_config("no_such_recipe")


def test_malformed_override_is_rejected():
    with pytest.raises(ValueError, match="dotted.field=value"):
        parse_override("trainer.lr")


def test_cli_reports_config_errors_without_a_traceback(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "trainer.steps=-3", "--dry-run"])
    assert exit_info.value.code == 2
    assert "trainer.steps" in capsys.readouterr().err


def test_overrides_may_come_before_and_after_an_option(capsys):
    main(["train", "scheduler.group_size=4", "--dry-run", "algo.loss=grpo"])
    printed = capsys.readouterr().out
    assert "loss: grpo" in printed and "group_size: 4" in printed
    with pytest.raises(SystemExit):
        main(["train", "--dry-run", "--no-such-option"])
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err
