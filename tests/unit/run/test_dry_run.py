"""`flashreinforce train --dry-run` makes the checks a run makes before it trains, and prints the config the run
would use: each stage resolved, nothing a run leaves unused."""

import re
import subprocess
import sys

import pytest
import yaml

from flashreinforce.cli import main
from flashreinforce.config import RECIPES_DIR, config_from_tree, load_config
from flashreinforce.run.preflight import resolved_tree, resolved_yaml

SHIPPED = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
USER_FIELDS = {"own_model": ["model.path=org/name", "data.train=train.jsonl", "data.eval=test.jsonl"]}
GPU_RECIPES = {"alfworld", "geo3k", "qwen3_tool_ablation", "qwen7b_tool", "qwen_math", "r1"}
NEED_EXTRAS = {"smollm2", "smollm2_multitask", "smollm2_agent"}
"""Their data is reasoning-gym's, or their agent needs the endpoint (extras); their model is converted by
`flashreinforce models get`."""
HEAVY = {"ernie", "ernie_mopd", "multitask"}
"""Their checks build every task's data for every stage: seconds, not a fraction of one."""


def dry_run(argv, capsys):
    """(exit code, stdout, stderr) of `flashreinforce train ARGV --dry-run`."""
    try:
        main(["train", *argv, "--dry-run"])
        code = 0
    except SystemExit as done:
        code = done.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("overrides", "says"), [
    (["algo.options.detla=0.01"], r"unknown option\(s\) \['detla'\] .*did you mean 'delta'"),
    (["env.kind=pyhon_tool"], r"env.kind='pyhon_tool' is not a known environment \(did you mean 'python_tool'\?\)"),
    (["verifier.reward_fn=no_such_rewards.py:score"], r"verifier.reward_fn: .*no_such_rewards.py not found"),
    (["model.path=org/name", "data.kind=files", "data.train=no_such.jsonl", "data.eval=no_such.jsonl"],
     r"data.train=no_such.jsonl does not exist"),
    (["algo.loss=misc", "scheduler.group_size=2", "algo.options={eps_low: -1}"], r"eps_low=-1"),
])
def test_a_dry_run_fails_where_the_run_would(overrides, says, capsys, tiny_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = dry_run([*tiny_run, *overrides], capsys)
    assert code == 2 and re.search(says, err), err
    assert "name: arithmetic" in out, "the resolved config is printed before the checks"


def test_a_user_reward_function_is_imported_and_its_signature_checked(capsys, tiny_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text("def score(completion):\n    return 1.0\n")
    code, _, err = dry_run([*tiny_run, "verifier.reward_fn=rewards.py:score"], capsys)
    assert code == 2 and "cannot be called as score(completion, ground_truth, prompt)" in err
    (tmp_path / "fixed.py").write_text("def score(completion, ground_truth, prompt):\n    return 1.0\n")
    code, _, err = dry_run([*tiny_run, "verifier.reward_fn=fixed.py:score"], capsys)  # a module is imported once
    assert code == 0 and "dry run: checked the run" in err


def test_a_stage_is_checked_before_the_first_one_runs(capsys, tiny_run):
    stages = "stages=[{name: a, steps: 2}, {name: b, steps: 2, env: {kind: pyhon_tool}}]"
    code, _, err = dry_run([*tiny_run, stages], capsys)
    assert code == 2 and "stages[1] (b): env.kind='pyhon_tool'" in err


@pytest.mark.parametrize(("argv", "says"), [
    (["arithmetc"], r"unknown recipe 'arithmetc' \(did you mean 'arithmetic'\?\)"),
    (["trainer.lrr=1e-4"], r"trainer.lrr: unknown field \(did you mean 'lr'\?\); `flashreinforce config trainer`"),
    (["ernie", "tasks.sumz.weight=2"], r"the recipe has no task 'sumz' \(did you mean 'sums'\?\)"),
    (["ernie", "stages.1.tasks={sumz: {weight: 2}}"],
     r"stages\[1\] \(reason\): tasks.sumz is not one of the recipe's tasks .* \(did you mean 'sums'\?\)"),
])
def test_a_misspelt_recipe_field_or_task_says_what_was_meant(argv, says, capsys):
    code, _, err = dry_run(argv, capsys)
    assert code == 2 and re.search(says, err), err


def test_a_stage_prints_its_resolved_sections_not_its_overrides(capsys, tiny_run):
    stages = ("stages=[{name: a, steps: 2, algo: {loss: grpo}, scheduler: {group_size: 4, batch_groups: 2}},"
              " {name: b, steps: 3}]")
    code, out, err = dry_run([*tiny_run, "algo.options={delta: 0.01}", stages], capsys)
    assert code == 0, err
    printed = yaml.safe_load(out)
    first, second = printed["stages"]
    assert set(first) == {"name", "kind", "steps", "optimizer", "algo", "scheduler"}, "no section left null"
    assert first["algo"]["options"] == {} and "dynamic_sampling" in first["algo"], "grpo's own, resolved"
    assert first["scheduler"]["group_size"] == 4 and "max_staleness" in first["scheduler"]
    assert set(second) == {"name", "kind", "steps", "optimizer"}
    assert "tasks" not in printed, "a one-task run prints no tasks"


def test_a_run_of_tasks_prints_no_section_the_tasks_leave_unused():
    tree = resolved_tree(load_config("multitask"))
    assert "data" not in tree and "env" not in tree and "reward_fn" not in tree["verifier"]
    assert "timeout_s" in tree["verifier"] and set(tree["tasks"]) == {"sums", "tool", "follow", "most"}


@pytest.mark.parametrize("recipe", SHIPPED)
def test_the_printed_config_reads_back_as_the_same_run(recipe):
    config = load_config(recipe, USER_FIELDS.get(recipe, []))
    again = config_from_tree(yaml.safe_load(resolved_yaml(config)))
    if config.stages is None:
        assert again == config
    else:
        count = len(config.stages)
        assert [again.stage(i) for i in range(count)] == [config.stage(i) for i in range(count)]


@pytest.mark.parametrize("recipe", [pytest.param(r, marks=pytest.mark.slow) if r in HEAVY else r
                                    for r in SHIPPED if r not in GPU_RECIPES | NEED_EXTRAS | set(USER_FIELDS)])
def test_every_cpu_recipe_passes_its_dry_run(recipe, capsys):
    code, out, err = dry_run([recipe], capsys)
    assert code == 0, err
    assert f"name: {recipe}" in out and "dry run: checked" in err


@pytest.mark.parametrize("recipe", sorted(GPU_RECIPES))
def test_a_gpu_recipe_on_this_machine_stops_naming_what_it_lacks(recipe, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where none of its model and data files are
    code, out, err = dry_run([recipe], capsys)
    assert code == 2 and f"name: {recipe}" in out
    assert re.search(r"needs the ray extra|needs vLLM|does not exist|alfworld", err), err
    local = ["backend.kind=local", "rollout.engine=local", "env.kind=math", "env.reward=verifier"]
    code, _, err = dry_run([recipe, *local], capsys)
    assert code == 2 and "does not exist" in err and f"recipes/{recipe}.yaml) says what it holds" in err, err


def test_train_help_lists_the_shipped_recipes(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    shown = capsys.readouterr().out
    assert "arithmetic (default)" in shown and all(f"  {recipe} " in shown for recipe in SHIPPED)


def test_config_answers_without_importing_torch():
    code = ("import sys\nfrom flashreinforce.cli import main\nmain(['config', 'trainer'])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "trainer.lr:" in done.stdout
