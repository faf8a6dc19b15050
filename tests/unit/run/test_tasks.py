"""A run as a mixture of tasks (config `tasks:`): a recipe without it is the one task of its sections, exactly as
before; a mixture's prompts, order, engine shape, verifiers and tokenizer follow its tasks."""

import pytest

from flashreinforce.config import load_config
from flashreinforce.data.order import PromptOrder
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.envs.worker import EnvSessions
from flashreinforce.envs.protocol import EnvSpec
from flashreinforce.run.backends import check_buildable, verifier_options
from flashreinforce.run.data import load_data
from flashreinforce.run.engines import engine_shape
from flashreinforce.run.policy import tiny_tokenizer
from flashreinforce.run.scheduling import run_order
from flashreinforce.verifiers.pool import VerifierPool
from flashreinforce.verifiers.registry import parse_spec, spec_ref

BUILT_IN_DATA = ["arithmetic", "arithmetic_grpo", "arithmetic_sync", "arithmetic_april", "arithmetic_urb",
                 "arithmetic_moe", "tool_multiply", "text_game", "instructions"]
SMALL = {"arithmetic": "data.arithmetic.num_train=200", "tool_multiply": "data.tool_multiply.num_train=200",
         "text_game": "data.text_game.num_train=100", "instructions": "data.instructions.num_train=200"}
MIX = ("tasks={math: {weight: 3, data: {kind: arithmetic, arithmetic: {num_train: 60, num_eval: 6}}},"
       " tool: {data: {kind: tool_multiply, tool_multiply: {num_train: 40, num_eval: 4}},"
       " env: {kind: python_tool, max_turns: 3, max_prompt_tokens: 16}, rollout: {max_new_tokens: 90},"
       " verifier: {kind: exact}}}")


@pytest.mark.parametrize("recipe", BUILT_IN_DATA)
def test_a_recipe_without_tasks_is_its_one_task_and_orders_its_prompts_as_before(recipe):
    config = load_config(recipe)
    config = load_config(recipe, [SMALL[config.data.kind]])
    assert config.tasks is None and [name for name, _ in config.task_list()] == [""]
    assert config.for_task("").model_dump() == config.model_dump()
    data = load_data(config)
    assert not data.by_task and all(p.task == "" and "/" not in p.id.split("/", 1)[0] for p in data.train[:5])
    order, before = run_order(config, data), PromptOrder(data.train, seed=config.data.shuffle_seed)
    positions = 3 * config.scheduler.batch_groups
    assert [order[i].id for i in range(positions)] == [before[i].id for i in range(positions)]
    assert verifier_options(config)["reward_fns"] == [spec_ref(parse_spec(config.verifier.reward_fn))]


def test_a_mixtures_prompts_carry_their_task_and_interleave_by_weight_the_same_after_a_restart():
    config = load_config(None, [MIX])
    data = load_data(config)
    assert {name: (len(train), len(held_out)) for name, (train, held_out) in data.by_task.items()} == \
        {"math": (60, 6), "tool": (40, 4)}
    assert all(p.id.startswith(f"{p.task}/") for p in data.train + data.eval)
    order = run_order(config, data)
    tasks = [order[i].task for i in range(400)]
    assert tasks.count("math") == 300 and tasks.count("tool") == 100
    again = run_order(load_config(None, [MIX]), load_data(load_config(None, [MIX])))
    assert [again[i].id for i in (399, 5, 123, 0)] == [order[i].id for i in (399, 5, 123, 0)]


def test_the_engines_fit_the_most_demanding_task_and_the_tokenizer_knows_every_tasks_characters():
    config = load_config(None, [MIX, "model.tiny.max_position_embeddings=128"])
    tokenizer = tiny_tokenizer(config)
    assert {"<think>", "<code>", "<output>"} <= set(tokenizer.get_vocab())
    shape = engine_shape(config, TextEpisodes(tokenizer), load_data(config), 128, version=0, seed=0)
    assert (shape.context, shape.max_new_tokens) == (16 + 90, 90)  # the tool task: its prompt room and budget
    assert shape.room_setting.startswith("task tool: env.max_prompt_tokens=16")
    too_small = load_config(None, [MIX, "model.tiny.max_position_embeddings=100"])
    with pytest.raises(ValueError, match=r"task tool: env.max_prompt_tokens=16.*need 106 positions but the model "
                                         r"has 100"):
        from flashreinforce.run.engines import check_tiny_context
        check_tiny_context(too_small, load_data(too_small))


def test_each_task_is_scored_by_its_own_verifier(tmp_path):
    options = verifier_options(load_config(None, [MIX]))
    assert options["task_refs"] == {"math": "math", "tool": "exact"} and options["reward_fns"] == ["math", "exact"]
    data = load_data(load_config(None, [MIX]))
    math_prompt, tool_prompt = data.by_task["math"][0][0], data.by_task["tool"][0][0]
    with VerifierPool(**{**options, "min_workers": 1, "max_workers": 1}) as pool:
        assert pool.score_sync(f"The answer is {math_prompt.ground_truth}", math_prompt).passed  # math finds it
        assert not pool.score_sync(f"The answer is {tool_prompt.ground_truth}", tool_prompt).passed  # exact: no
        assert pool.score_sync(tool_prompt.ground_truth, tool_prompt).passed


def test_one_worker_holds_environments_of_several_tasks_kinds(tmp_path):
    (tmp_path / "envs.py").write_text(
        "from flashreinforce.envs.protocol import StepResult\n"
        "class Echo:\n"
        "    def reset(self, prompt, seed): return 'echo ' + prompt.task\n"
        "    def step(self, action): return StepResult(action, 1.0, True, {})\n"
        "    def close(self): pass\n"
        "class Shout(Echo):\n"
        "    def reset(self, prompt, seed): return 'SHOUT ' + prompt.task\n")
    from flashreinforce.types import Prompt

    sessions = EnvSessions({"a": EnvSpec(kind="envs.py:Echo", base_dir=str(tmp_path)),
                            "b": EnvSpec(kind="envs.py:Shout", base_dir=str(tmp_path))})
    assert sessions.handle(("open", "1", Prompt("a/1", "x", "", task="a"), 0, ())) == ("ok", "echo a")
    assert sessions.handle(("open", "2", Prompt("b/1", "x", "", task="b"), 0, ())) == ("ok", "SHOUT b")
    assert sessions.handle(("step", "1", "hi"))[1].observation == "hi"
    kind, message = sessions.handle(("open", "3", Prompt("c/1", "x", "", task="c"), 0, ()))
    assert kind == "error" and "task 'c', which has no environment here" in message


@pytest.mark.parametrize(("tasks", "message"), [
    ("{Bad/Name: {data: {kind: arithmetic}}}", "tasks.Bad/Name: a task name is a letter"),
    ("{total: {data: {kind: arithmetic}}}", r"not one of \['all', 'mean', 'total', 'worst'\]"),
    ("{}", "tasks: empty"),
    ("{a: {weight: 0, data: {kind: arithmetic}}}", "tasks.a.weight: Input should be greater than 0"),
    ("{a: {weight: 1}}", "tasks.a.data: Field required"),
    ("{a: {data: {kind: arithmetic}, envv: {}}}", "tasks.a.envv: unknown field"),
    ("{a: {data: {kind: arithmetic}, verifier: mathh}}", "unknown verifier 'mathh'; the registered ones"),
    ("{a: {data: {kind: tool_multiply}}}", "tasks.a.data.kind=tool_multiply is an agent task: set tasks.a.env"),
])
def test_a_bad_task_is_refused_naming_the_task_and_field(tasks, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [f"tasks={tasks}"])


def test_tasks_beside_the_runs_own_data_or_env_section_is_refused_and_an_unknown_env_kind_named():
    with pytest.raises(ValueError, match=r"tasks: and the run's env section both given; .*tasks.<name>.env"):
        load_config(None, [MIX, "env.max_workers=1"])
    config = load_config(None, ["tasks={a: {data: {kind: arithmetic}, env: {kind: chess}}}"])
    with pytest.raises(ValueError, match="env.kind='chess'"):
        check_buildable(config)


def test_a_row_no_route_claims_is_refused_before_any_work_naming_the_task_and_the_source(tmp_path):
    import json

    from flashreinforce.run.backends import check_verifiers

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"q{i}", "reward_model": {"ground_truth": "1"},
                                        "data_source": source}) + "\n" for i, source in enumerate(["sums", "trivia"])))
    task = f"{{data: {{kind: files, train: {rows}, eval: {rows}}}, verifier: {{route: {{sums: math}}}}}}"
    config = load_config(None, [f"tasks={{mixed: {task}}}", "model.path=/a/model"])
    with pytest.raises(ValueError, match=r"tasks.mixed.verifier: rows with data_source 'trivia' have no route"):
        check_verifiers(config, load_data(config))
    routed = load_config(None, [f"tasks={{mixed: {task.replace('sums: math', 'sums: math, trivia: exact')}}}",
                                "model.path=/a/model"])
    check_verifiers(routed, load_data(routed))
