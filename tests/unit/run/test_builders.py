"""The run layer's builders: parts this build cannot make are refused before any work, naming the field."""

import pytest

from flashreinforce.config import load_config
from flashreinforce.run import run_training
from flashreinforce.run.backends import build_episodes, check_buildable
from flashreinforce.run.engines import ENGINES, EngineShape, build_engine, longest_prompt
from flashreinforce.run.tables import pick_builder
from flashreinforce.run.data import load_data
from flashreinforce.run.policy import tiny_policy


def test_a_kind_without_a_builder_is_refused_naming_its_field():
    with pytest.raises(ValueError, match=r"rollout.engine=sglang is not available in this build yet; use one of "
                                         r"\['local', 'vllm'\]"):
        pick_builder(ENGINES, "rollout.engine", "sglang")


@pytest.mark.parametrize(("kind", "says"), [("chess", "is not a known environment"),
                                             ("missing_env.py:Env", "no file")])
def test_an_environment_that_cannot_be_built_is_refused_naming_env_kind(kind, says):
    with pytest.raises(ValueError, match=f"env.kind='{kind}'.*{says}"):
        check_buildable(load_config(None, [f"env.kind={kind}"]))


@pytest.mark.parametrize("recipe", ["r1", "qwen_math", "qwen7b_tool", "qwen3_tool_ablation", "alfworld", "geo3k"])
def test_a_gpu_recipe_starts_and_stops_only_at_what_this_machine_lacks(recipe, tmp_path):
    """Every part a GPU recipe names has a builder; here it stops at the first thing it needs that a CPU
    machine does not have (vLLM, Ray, or the recipe's data), saying what and how to get it."""
    with pytest.raises((ValueError, ImportError)) as stopped:
        run_training(load_config(recipe, ["log.progress=false"]), run_dir=tmp_path / "run")
    message = str(stopped.value)
    assert "not available in this build" not in message
    assert any(what in message for what in ("install_vllm_cpu.sh", "ray extra", "does not exist")), message


def test_the_engine_context_is_the_longest_prompt_plus_the_budget_and_the_model_must_hold_it(tiny_run):
    config = load_config(None, tiny_run)
    policy, data = tiny_policy(config), load_data(config)
    longest = longest_prompt(config, build_episodes(config, policy.tokenizer), data).tokens
    engine = build_engine(config, policy, EngineShape(longest, 40, version=3, seed=0))
    assert engine.max_context == longest + 40 and engine.version == 3
    assert engine.model is not policy.model  # the engine decodes its own copy of the weights
    limit = config.model.tiny.max_position_embeddings
    expected = f"max_new_tokens=200 need {longest + 200} positions but the model has {limit}"
    with pytest.raises(ValueError, match=expected):
        build_engine(config, policy, EngineShape(longest, 200, version=0, seed=0))


def test_a_saved_character_tokenizer_keeps_spaces_and_newlines_beside_a_qwen2_config(tmp_path):
    # transformers 5's AutoTokenizer loads Qwen2Tokenizer next to a qwen2 config.json and drops " " and "\n"
    from flashreinforce.models import build_char_tokenizer, build_model
    from flashreinforce.models.tokenizer import load_tokenizer

    tokenizer = build_char_tokenizer("ab \n")
    build_model(len(tokenizer), 16, 1, 2, 32, pad_token_id=0, eos_token_id=1, dtype="float32",
                seed=0).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    ids = tokenizer.encode("a b\nb", add_special_tokens=False)
    assert loaded.encode("a b\nb", add_special_tokens=False) == ids and loaded.decode(ids) == "a b\nb"


def test_an_episodes_first_prompt_room_fits_the_model_unless_set_and_a_setting_too_big_is_named(tiny_run):
    """Unset, env.max_prompt_tokens takes what the model's context leaves after the budget (at most 512), so a
    multi-turn run on the default model starts; set too high, the error names env.max_prompt_tokens."""
    from flashreinforce.run.engines import FIRST_PROMPT_ROOM, model_context

    config = load_config(None, ["env.kind=my_env.py:Guess", "rollout.max_new_tokens=64"])
    policy, data = tiny_policy(config), load_data(config)
    episodes = build_episodes(config, policy.tokenizer)
    context = model_context(policy.model)
    room = longest_prompt(config, episodes, data, context)
    assert room.tokens == context - 64 and "env.max_prompt_tokens unset" in room.setting
    assert build_engine(config, policy, EngineShape.of(room, 64, 0, 0)).max_context == context
    assert longest_prompt(config, episodes, data, 8192).tokens == FIRST_PROMPT_ROOM  # a real model's context

    config = load_config(None, ["env.kind=my_env.py:Guess", "env.max_prompt_tokens=512"])
    room = longest_prompt(config, episodes, data, context)
    with pytest.raises(ValueError, match=rf"512 prompt tokens \(env.max_prompt_tokens=512, .*\) plus "
                                         rf"max_new_tokens=64 need 576 positions but the model has {context}"):
        build_engine(config, policy, EngineShape.of(room, 64, 0, 0))


def test_a_tiny_model_that_cannot_hold_the_run_stops_before_its_warm_start(tiny_run, tmp_path):
    config = load_config(None, [*tiny_run, "rollout.max_new_tokens=200", "sft.steps=100000"])
    with pytest.raises(ValueError, match="max_new_tokens=200 need .* positions but the model has"):
        run_training(config, run_dir=tmp_path / "run")
    assert not (tmp_path / "run" / "sft").exists()


GPU_RECIPE_PARAMS = {"r1": 1.78e9, "qwen_math": 1.54e9, "qwen7b_tool": 7.62e9, "alfworld": 7.62e9,
                     "qwen3_tool_ablation": 30.5e9, "geo3k": 3.75e9}
"""Parameters of each GPU recipe's model (its model card), for the memory its trainer ranks must hold."""


@pytest.mark.parametrize("recipe", sorted(GPU_RECIPE_PARAMS))
def test_a_gpu_recipe_states_its_hardware_and_its_trainer_ranks_hold_their_state_there(recipe):
    """The header's `Hardware: N GPUs of M GB` is one GPU per trainer rank and per engine, and each rank's weights,
    masters, gradients and AdamW state leave at least 10% of its GPU to activations."""
    import re

    from flashreinforce.config import resolve_recipe
    from flashreinforce.run.learner import training_state_bytes

    header = " ".join(line.lstrip("# ") for line in resolve_recipe(recipe).read_text().splitlines()
                      if line.startswith("#"))
    stated = re.search(r"Hardware: (\d+) GPUs of (\d+) GB", header)
    assert stated, f"{recipe}: no 'Hardware: N GPUs of M GB' in its header"
    gpus, memory = int(stated[1]), int(stated[2]) * 10**9
    config = load_config(recipe)
    assert gpus == config.trainer.world_size + config.backend.num_engines
    assert training_state_bytes(config, int(GPU_RECIPE_PARAMS[recipe])) <= 0.9 * memory
    if config.rollout.engine == "vllm":
        assert config.rollout.vllm.gpu_memory_utilization >= 0.8  # an engine alone on its GPU takes most of it


def test_a_trainer_rank_that_cannot_hold_its_state_on_its_gpu_stops_naming_the_ranks_that_would(monkeypatch):
    from types import SimpleNamespace

    import torch

    from flashreinforce.run.learner import check_fits_gpu, training_state_bytes

    gpu = SimpleNamespace(total_memory=80 * 2**30, name="a GPU of 80 GiB")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: gpu)
    config = load_config("qwen7b_tool", ["trainer.world_size=1", "trainer.sharding=replicate"])
    model = torch.nn.Linear(1, 1)
    monkeypatch.setattr(model, "parameters", lambda: [SimpleNamespace(numel=lambda: 7_620_000_000)])
    assert training_state_bytes(config, 7_620_000_000) == 7_620_000_000 * (2 + 4 + 4 + 8)
    with pytest.raises(ValueError, match=r"7.62B parameters .* need at least 128 GiB per trainer rank .* "
                                         r"set trainer.world_size=2 \(or more\) with trainer.sharding=fsdp"):
        check_fits_gpu(config, model, torch.device("cuda", 0))
    check_fits_gpu(load_config("qwen7b_tool"), model, torch.device("cuda", 0))  # 4 sharded ranks: 32 GiB each
    check_fits_gpu(config, model, torch.device("cpu"))  # a CPU rank is not checked against a GPU


def test_a_prompt_room_of_pictures_names_data_max_pixels():
    """A model whose image tokens grow with the picture can need more context than the text suggests: the setting
    an over-long prompt names is then data.max_pixels."""
    from flashreinforce.run.engines import prompt_room
    from flashreinforce.types import Prompt

    class Rendered:  # each image as 100 tokens, as a large picture on a dynamic-resolution model
        def prompt_ids(self, prompt):
            return [0] * (len(prompt.prompt) + 100 * len(prompt.images))

    config = load_config(None, [])
    text = Prompt(id="a", prompt="what is 1+1?", ground_truth="2")
    room = prompt_room(config, Rendered(), [text])
    assert room.tokens == 12 and "max_pixels" not in room.setting
    picture = Prompt(id="b", prompt="<image>what?", ground_truth="x", images=(b"png",))
    room = prompt_room(config, Rendered(), [text, picture])
    assert room.tokens == 112 and "data.max_pixels makes them fewer" in room.setting
