"""The shipped `vision` recipe end to end, cut down to a test's size: the tiny vision policy warm-started on the
drawn pictures, trained by RL on its exact-match reward, checkpointed with its encoder, and evaluated again."""

import json

import pytest
from safetensors.torch import load_file

from flashreinforce.cli import main
from flashreinforce.config import load_config
from flashreinforce.models.vision import VisionLM
from flashreinforce.run import run_training
from flashreinforce.run.policy import load_policy

pytestmark = pytest.mark.slow  # a whole run, ~15 s


def test_the_vision_recipe_trains_the_encoder_with_the_lm_and_saves_both(vision_run, tmp_path):
    # A warm start long enough to answer in the tasks' format, so some rewards differ and RL has a gradient.
    config = load_config(vision_run[0], [*vision_run[1:], "sft.steps=150"])
    run = tmp_path / "run"
    summary = run_training(config, run_dir=run)
    assert summary["optimizer_steps"] == 3
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all("<image>" not in s["completion"] for s in samples)  # image tokens are never sampled
    final = run / "checkpoints" / "step_000003" / "model"
    policy = load_policy(final)
    assert isinstance(policy.model, VisionLM)
    # The encoder trained with the LM (the tiny model's default): its weights moved from the warm start's.
    warm, trained = load_file(run / "sft" / "vision.safetensors"), load_file(final / "vision.safetensors")
    assert any(not (warm[name] == trained[name]).all() for name in warm)
    main(["eval", str(final.parent), "--num-prompts", "8", "--k", "1", "--json", str(tmp_path / "eval.json")])
    scores = json.loads((tmp_path / "eval.json").read_text())
    assert scores["num_prompts"] == 3 * 8 and scores["model"] == str(final)  # 8 of each of the recipe's 3 tasks


def test_a_frozen_encoder_stays_as_the_warm_start_left_it(vision_run, tmp_path):
    config = load_config(vision_run[0], [*vision_run[1:], "trainer.freeze_vision=true", "trainer.steps=2"])
    run = tmp_path / "run"
    run_training(config, run_dir=run)
    warm = load_file(run / "sft" / "vision.safetensors")
    trained = load_file(run / "checkpoints" / "step_000002" / "model" / "vision.safetensors")
    assert all((warm[name] == trained[name]).all() for name in warm)
