"""data.kind=reasoning_gym: task specs, deterministic disjoint splits, the mapping to Prompt, and the errors.

Most tests run a stand-in for the reasoning_gym package (same create_dataset / factory.DATASETS surface, items
drawn from Random(seed + index) like reasoning-gym's), so they need neither the package nor its import time;
the last ones use the real package and skip, naming the install command, when it is missing.
"""

import dataclasses
import random
import sys
import types

import pytest

from flashreinforce.config import ReasoningGymConfig, load_config
from flashreinforce.data import reasoning_gym as rgdata
from flashreinforce.data.reasoning_gym import (
    DEFAULT_INSTRUCTION,
    EVAL_SEED_OFFSET,
    INSTALL_HINT,
    apportion,
    check_task_names,
    make_reasoning_gym_splits,
    task_specs,
    to_prompt,
)
from flashreinforce.types import Prompt

SKIP_REASON = f"reasoning-gym is not installed: {INSTALL_HINT}"


@dataclasses.dataclass
class _SumsConfig:
    max_value: int = 9
    seed: int | None = None
    size: int = 500

    def validate(self):
        assert self.max_value >= 1, "max_value must be >= 1"


class _Sums:
    """`a + b` with a, b <= max_value, item i from Random(seed + i): few distinct problems when max_value is small."""

    def __init__(self, config):
        config.validate()
        self.config, self.seed = config, config.seed

    def __getitem__(self, idx):
        rng = random.Random(self.seed + idx)
        a, b = rng.randint(0, self.config.max_value), rng.randint(0, self.config.max_value)
        return {"question": f"What is {a} + {b}?", "answer": str(a + b),
                "metadata": {"difficulty": {"max_value": self.config.max_value}, "answer_cot": f"{a}+{b}={a + b}"}}


def _fake_reasoning_gym():
    datasets = {"sums": (_Sums, _SumsConfig), "chain_sum": (_Sums, _SumsConfig)}

    def create_dataset(name, **kwargs):
        return datasets[name][0](datasets[name][1](**kwargs))

    return types.SimpleNamespace(create_dataset=create_dataset, factory=types.SimpleNamespace(DATASETS=datasets))


@pytest.fixture
def fake_rg(monkeypatch):
    monkeypatch.setattr(rgdata, "import_reasoning_gym", _fake_reasoning_gym)


def _splits(tasks=("sums",), config=None, num_train=200, num_eval=50, seed=7, **kwargs):
    config = {"sums": {"max_value": 1000}} if config is None else config
    return make_reasoning_gym_splits(list(tasks), config=config, num_train=num_train, num_eval=num_eval, seed=seed,
                                     **kwargs)


def test_task_specs_weights_and_options():
    specs = task_specs(["a", "b"], {"b": {"x": 1}})
    assert [(s.name, s.weight, s.options) for s in specs] == [("a", 1.0, {}), ("b", 1.0, {"x": 1})]
    assert [s.weight for s in task_specs({"a": 3, "b": 1}, {})] == [3.0, 1.0]


@pytest.mark.parametrize(("tasks", "config", "message"), [
    ([], {}, "tasks is empty"),
    (["a", "a"], {}, "names a task twice"),
    ({"a": 0}, {}, "tasks.a: weight 0"),
    (["a"], {"b": {"x": 1}}, "config.b: 'b' is not in data.reasoning_gym.tasks"),
    (["a"], {"a": {"seed": 1}}, "config.a: ['seed'] are set by the loader"),
])
def test_task_specs_errors_name_the_field(tasks, config, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        task_specs(tasks, config)


def test_apportion_is_exact_and_stable():
    assert apportion(10, [1, 1, 1]) == [4, 3, 3]
    assert apportion(7, [3, 1]) == [5, 2]
    assert apportion(0, [1, 2]) == [0, 0]
    assert sum(apportion(257, [0.2, 0.3, 0.5])) == 257


def test_unknown_task_lists_close_matches():
    with pytest.raises(ValueError, match="unknown reasoning-gym task 'leg_countin'; did you mean leg_counting"):
        check_task_names(["leg_countin"], ["basic_arithmetic", "leg_counting"])
    with pytest.raises(ValueError, match="unknown reasoning-gym task 'zzz'; there are 2, e.g. basic_arithmetic"):
        check_task_names(["zzz"], ["basic_arithmetic", "leg_counting"])


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` now raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'flashreinforce\[reasoning-gym\]'"):
        _splits()


def test_same_config_same_prompts(fake_rg):
    assert _splits() == _splits()
    assert _splits().train != _splits(seed=8).train


def test_splits_are_disjoint_and_held_out_distinct(fake_rg):
    splits = _splits(num_train=300, num_eval=100)
    train_questions = {p.prompt[0]["content"] for p in splits.train}
    eval_questions = [p.prompt[0]["content"] for p in splits.eval]
    assert len(set(eval_questions)) == len(eval_questions)
    assert not train_questions & set(eval_questions)
    assert len({p.id for p in splits.train + splits.eval}) == len(splits.train) + len(splits.eval)


def test_training_skips_held_out_questions_and_the_held_out_split_keeps_its_share(fake_rg):
    # max_value=3: 16 distinct sums, so many draws repeat; the held-out split is drawn first and kept distinct.
    splits = _splits(config={"sums": {"max_value": 3}}, num_train=40, num_eval=12)
    held = [p.prompt[0]["content"] for p in splits.eval]
    assert len(held) == len(set(held)) == 12 - splits.eval_repeats
    assert len(splits.train) == 40 and splits.train_skipped > 0  # skipped draws were replaced by later ones
    assert not {p.prompt[0]["content"] for p in splits.train} & set(held)


def test_a_task_with_no_problem_left_for_training_is_an_error(fake_rg):
    # max_value=1: four problems, all of them drawn into the held-out split.
    with pytest.raises(ValueError, match="only 0 of 20 training sums items avoid the held-out questions after 200"):
        _splits(config={"sums": {"max_value": 1}}, num_train=20, num_eval=40)


def test_eval_seed_range_never_meets_the_training_range(fake_rg, monkeypatch):
    # Item i of a split draws from Random(seed + i): the held-out seed is the training seed + 2**30.
    seeds, real = [], rgdata.generate

    def recording(rg, spec, *, seed, **kwargs):
        seeds.append(seed)
        return real(rg, spec, seed=seed, **kwargs)

    monkeypatch.setattr(rgdata, "generate", recording)
    _splits()
    eval_seed, train_seed = sorted(set(seeds), reverse=True)
    assert eval_seed == train_seed + EVAL_SEED_OFFSET and 0 <= train_seed < EVAL_SEED_OFFSET
    assert eval_seed + 50 < 2**32  # numpy's seed limit, which some reasoning-gym tasks use


def test_weights_split_the_counts(fake_rg):
    splits = make_reasoning_gym_splits({"sums": 3, "chain_sum": 1}, config={}, num_train=40, num_eval=20, seed=1)
    sources = [p.data_source for p in splits.train]
    assert sources.count("sums") == 30 and sources.count("chain_sum") == 10
    assert sources != sorted(sources)  # the tasks are interleaved
    # two tasks with alike generators still draw different problems (per-task seeds)
    sums = {p.prompt[0]["content"] for p in splits.train if p.data_source == "sums"}
    chain = {p.prompt[0]["content"] for p in splits.train if p.data_source == "chain_sum"}
    assert len(sums & chain) < 5


def test_items_map_to_chat_prompts(fake_rg):
    item = _splits(num_train=1, num_eval=1).train[0]
    assert isinstance(item, Prompt) and item.id == "sums/train/000000" and item.data_source == "sums"
    (message,) = item.prompt
    assert message["role"] == "user"
    assert message["content"].startswith("What is ") and message["content"].endswith(f"?\n\n{DEFAULT_INSTRUCTION}")
    a, b = (int(x) for x in message["content"].split("?")[0].removeprefix("What is ").split(" + "))
    assert item.ground_truth == str(a + b) and item.reference_think == f"{a}+{b}={a + b}"
    assert item.difficulty is None  # a dict of settings is not a number


def test_to_prompt_fields():
    item = {"question": "Q?\n", "answer": 12, "metadata": {"difficulty": 1.0, "answer_cot": "a\n#### 12"}}
    prompt = to_prompt(item, task="gsm_symbolic", prompt_id="x/0", instruction="Say it.")
    assert prompt.prompt == ({"role": "user", "content": "Q?\n\nSay it."},)
    assert (prompt.ground_truth, prompt.reference_think, prompt.difficulty) == ("12", "a\n#### 12", 1.0)
    assert to_prompt(item, task="t", prompt_id="x/1", instruction="").prompt[0]["content"] == "Q?\n"
    bare = to_prompt({"question": "Q", "answer": "1", "metadata": {}}, task="t", prompt_id="x", instruction="")
    assert bare.reference_think is None


def test_bad_generator_settings_name_the_task_and_its_fields(fake_rg):
    refused = r"config.sums=\{'max_digits': 2\}: reasoning-gym refused it .*settings are \['max_value'\]"
    with pytest.raises(ValueError, match=refused):
        _splits(config={"sums": {"max_digits": 2}})
    with pytest.raises(ValueError, match="max_value must be >= 1"):
        _splits(config={"sums": {"max_value": 0}})


def test_config_default_instruction_is_the_loaders():
    assert ReasoningGymConfig().instruction == DEFAULT_INSTRUCTION


# ---- with the real package ----

@pytest.mark.reasoning_gym
def test_real_tasks_are_deterministic_and_map_worked_solutions():
    pytest.importorskip("reasoning_gym", reason=SKIP_REASON)
    config = {"basic_arithmetic": {"max_terms": 2, "max_digits": 2, "operators": ["+", "-"],
                                   "allow_parentheses": False, "allow_negation": False}}
    first = make_reasoning_gym_splits(["basic_arithmetic", "gsm_symbolic"], config=config, num_train=20,
                                      num_eval=10, seed=3)
    assert first == make_reasoning_gym_splits(["basic_arithmetic", "gsm_symbolic"], config=config, num_train=20,
                                              num_eval=10, seed=3)
    gsm = [p for p in first.train if p.data_source == "gsm_symbolic"]
    assert len(gsm) == 10 and all(p.reference_think and "####" in p.reference_think for p in gsm)
    assert all(p.difficulty == 1.0 for p in gsm)
    assert all(p.reference_think is None for p in first.train if p.data_source == "basic_arithmetic")
    with pytest.raises(ValueError, match="did you mean basic_arithmetic"):
        make_reasoning_gym_splits(["basic_arithmetik"], config={}, num_train=1, num_eval=1, seed=0)
    with pytest.raises(ValueError, match="config.basic_arithmetic=.*reasoning-gym refused it.*min_terms"):
        make_reasoning_gym_splits(["basic_arithmetic"], config={"basic_arithmetic": {"terms": 2}}, num_train=1,
                                  num_eval=1, seed=0)


@pytest.mark.reasoning_gym
def test_load_config_and_load_data(tmp_path):
    pytest.importorskip("reasoning_gym", reason=SKIP_REASON)
    from flashreinforce.run.data import load_data

    config = load_config(None, ["data.kind=reasoning_gym", f"model.path={tmp_path}",
                                "data.reasoning_gym.tasks={leg_counting: 1, basic_arithmetic: 1}",
                                "data.reasoning_gym.config.leg_counting={min_animals: 1, max_animals: 2}",
                                "data.reasoning_gym.num_train=30", "data.reasoning_gym.num_eval=10"])
    data = load_data(config)
    assert len(data.train) == 30 and 0 < len(data.eval) <= 10 and data.skipped_rows == 0
    assert {p.data_source for p in data.train} == {"leg_counting", "basic_arithmetic"}
    with pytest.raises(ValueError, match="model.path is required with data.kind=reasoning_gym"):
        load_config(None, ["data.kind=reasoning_gym"])
    with pytest.raises(ValueError, match="data.kind=gsm8k trains on gsm_symbolic"):
        load_data(load_config(None, ["data.kind=gsm8k", f"model.path={tmp_path}",
                                     "data.reasoning_gym.tasks=[leg_counting]"]))
