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
def test_every_shipped_recipe_parses(recipe):
    """(Its dry run, which also makes the run's checks: tests/unit/run/test_dry_run.py.)"""
    if recipe in USER_FIELDS:
        with pytest.raises(ValueError, match=r"data.train=\.\.\., data.eval=\.\.\."):
            load_config(recipe)
    config = load_config(recipe, USER_FIELDS.get(recipe, []))
    assert config.name == recipe


BF16_PROBE_GAP = 0.25
"""docs/vllm.md: vLLM's bf16 log-probs of the push probe's row against our forward of the same weights, on a
30-layer model (SmolLM2-135M), differ by up to this."""


@pytest.mark.parametrize("recipe", SHIPPED)
def test_a_bf16_vllm_recipe_tolerates_the_measured_bf16_gap_at_its_push_probe(recipe):
    config = load_config(recipe, USER_FIELDS.get(recipe, []))
    if config.rollout.engine != "vllm" or config.precision.rollout != "bf16":
        return
    assert (config.rollout.vllm.probe_tolerance or 0) >= 2 * BF16_PROBE_GAP, "the default 0.05 refuses the start"


def test_overrides_reach_nested_fields():
    config = load_config(None, ["trainer.lr=1e-5", "scheduler.kind=urb", "algo.options.delta=inf"])
    assert config.trainer.lr == 1e-5
    assert config.scheduler.kind == "urb"
    assert math.isinf(config.algo.options["delta"])


@pytest.mark.parametrize(("written", "setting"), [("off", "off"), ("on", "on"), ("'off'", "off"), ("auto", "auto")])
def test_a_bare_on_or_off_is_the_setting_though_yaml_reads_it_as_a_boolean(written, setting, tmp_path):
    assert load_config("arithmetic", [f"rollout.fused_decode={written}"]).rollout.fused_decode == setting
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"inherit: arithmetic\nrollout: {{fused_decode: {written}}}\n")
    assert load_config(str(recipe)).rollout.fused_decode == setting


def test_a_numeric_override_key_indexes_a_list_and_a_bad_index_names_the_range():
    config = load_config("ernie", ["stages.1.steps=7", "stages.3.scheduler.batch_groups=6"])
    assert config.stages[1].steps == 7 and config.stages[3].scheduler["batch_groups"] == 6
    assert config.stages[2].steps == load_config("ernie").stages[2].steps
    with pytest.raises(ValueError, match="stages is a list of 4: index it with 0 to 3, not '4'"):
        load_config("ernie", ["stages.4.steps=1"])
    with pytest.raises(ValueError, match="seed is a value, not a section"):
        load_config(None, ["seed.x=1"])


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
        (["algo.loss=grpo", "scheduler.group_size=2", "algo.wpsm={tau: 0.5, eta: 0.3, rate: group, positive_only: true}"],
         "algo.wpsm can never flag a row: .*group_size=2 .* raise group_size above 2 or lower tau"),
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


STAGED = ["tasks={sums: {weight: 2, data: {kind: arithmetic}}, game: {data: {kind: text_game}, env: {kind: text_game}}}"]


def test_a_stage_takes_the_recipes_tasks_by_name_and_merges_its_sections_over_the_recipe():
    config = load_config("arithmetic", [*STAGED, "trainer.lr=1e-4", "sft.steps=30", (
        "stages=[{name: warm, kind: sft, steps: 50},"
        " {name: one, steps: 20, tasks: {sums: {weight: 5}}, algo: {options: {baseline: task}}},"
        " {name: all, steps: 10, optimizer: reset, trainer: {lr: 2.0e-5}}]")])
    warm, one, every = (config.stage(i) for i in range(3))
    assert warm.sft.steps == 50 and warm.stages is None
    assert list(one.tasks) == ["sums"] and one.tasks["sums"].weight == 5
    assert one.tasks["sums"].data.kind == "arithmetic", "a named task keeps the recipe's definition"
    assert one.trainer.steps == 20 and one.trainer.lr == 1e-4 and one.algo.options == {"baseline": "task"}
    assert list(every.tasks) == ["sums", "game"] and every.trainer.lr == 2e-5 and every.trainer.steps == 10


@pytest.mark.parametrize(("stages", "message"), [
    ("[{name: a, steps: 5}, {name: a, steps: 5}]", r"stages\[1\].name='a': a stage name is unique"),
    ("[{name: a, steps: 5, trainer: {lr: -1}}]", r"stages\[0\] \(a\), merged over the recipe: trainer.lr"),
    ("[{name: a, steps: 5, tasks: {new: {weight: 1}}}]",
     r"stages\[0\] \(a\): tasks.new is not one of the recipe's tasks \(sums, game\); a new task needs its own data"),
    ("[{name: a, steps: 5, tasks: {sumz: {weight: 1}}}]", r"tasks.sumz .*\(did you mean 'sums'\?\)"),
    ("[{name: a, steps: 5, tasks: {new: {weight: 1, data: {kind: arithmetic}, verifer: math}}}]",
     r"tasks.new.verifer: unknown field \(did you mean 'verifier'\?\)"),
    ("[{name: a, steps: 5, model: {path: x}}]", r"stages.0.model: unknown field"),
    ("[]", "stages: empty"),
])
def test_a_bad_stage_is_named_at_load(stages, message):
    with pytest.raises(ValueError, match=message):
        load_config("arithmetic", [*STAGED, f"stages={stages}"])


def test_a_stage_naming_another_loss_takes_only_its_own_options():
    config = load_config("multitask", ["stages=[{name: a, steps: 5}, {name: b, steps: 5, scheduler: {group_size: 2},"
                                       " algo: {loss: misc, options: {eps_high: 0.001}}}, {name: c, steps: 5,"
                                       " algo: {options: {baseline: batch}}}]"])
    assert config.algo.options == {"baseline": "task"}
    assert config.stage(0).algo.options == {"baseline": "task"}
    assert config.stage(1).algo.loss == "misc" and config.stage(1).algo.options == {"eps_high": 0.001}
    assert config.stage(2).algo.options == {"baseline": "batch"}, "the same loss merges its options"


def test_a_stage_with_options_its_loss_does_not_take_stops_the_run_before_the_first_stage(tmp_path):
    from flashreinforce.run import run_training

    config = load_config("arithmetic", ["stages=[{name: a, steps: 5}, {name: b, steps: 5, scheduler: {group_size: 2},"
                                        " algo: {loss: misc, options: {eps_low: -1}}}]"])
    with pytest.raises(ValueError, match=r"stages\[1\] \(b\): option eps_low=-1"):
        run_training(config, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_an_sft_stage_needs_a_task_with_demonstrations():
    with pytest.raises(ValueError, match=r"stages\[0\] \(w\): kind sft .* data.kind=files has none: make it an rl "
                                         "stage"):
        load_config("own_model", ["model.path=org/name", "data.train=a.jsonl", "data.eval=b.jsonl",
                                  "stages=[{name: w, kind: sft, steps: 5}]"])
    # A pretrained model fine-tunes on a built-in task's demonstrations (the smollm2_tool recipe does).
    config = load_config("smollm2_tool", ["model.path=org/name"])
    assert [stage.kind for stage in config.stages] == ["sft", "rl"]


def test_chat_prompts_need_a_chat_model():
    with pytest.raises(ValueError, match="data.tool_multiply.chat=true renders prompts with a chat model's template"):
        load_config("tool_multiply", ["data.tool_multiply.chat=true"])


@pytest.mark.parametrize("recipe", ["ernie", "ernie_mopd"])
def test_a_warm_stage_demonstrates_sums_beyond_those_its_rl_stages_train_on(recipe):
    """600 SFT steps on the 2,000 sums the RL stages train on memorize them (held-out sums ~2% after SFT, ~35%
    from 20,000): each recipe's warm stage demonstrates 20,000, whose first 2,000 are the RL stages' own."""
    config = load_config(recipe)
    assert config.stages[0].kind == "sft"
    assert dict(config.stage(0).task_list())["sums"].data.arithmetic.num_train == 20000
    for index, stage in enumerate(config.stages[1:], start=1):
        tasks = dict(config.stage(index).task_list())
        if "sums" in tasks:
            assert tasks["sums"].data.arithmetic.num_train == 2000, stage.name
