"""The shipped `visual_grid` recipe end to end, cut down to a test's size: the tiny vision policy, warm-started on an
expert's moves with each turn's picture in the row, plays the grid by RL on the environment's reward (every
observation a picture), is checkpointed and evaluated on held-out layouts."""

import json

import pytest

from flashreinforce.cli import main
from flashreinforce.models.image_tokens import IMAGE_TOKEN

pytestmark = pytest.mark.slow  # a whole run and an evaluation, ~10 s


def test_the_visual_grid_recipe_trains_on_episodes_that_see_a_picture_every_turn(vision_agent_run, tmp_path):
    run = tmp_path / "run"
    main(["train", "--output", str(run), *vision_agent_run])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["optimizer_steps"] == 3 and summary["trained_trajectories"] == 24
    assert summary["dropped_trajectories"] == {}  # no environment error: every observation's pictures fit
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    picture = IMAGE_TOKEN * 4  # one 32x32 picture: 4 image tokens
    assert all(s["prompt"] == f"reach the goal.\n{picture}move:\n" for s in samples)  # no position in the text
    assert any(f"\n{picture}move:\n" in s["completion"] for s in samples)  # later turns saw new pictures
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert not any("env/env_error" in row for row in steps)
    main(["eval", str(run), "--num-prompts", "4", "--k", "1", "--json", str(tmp_path / "eval.json")])
    scores = json.loads((tmp_path / "eval.json").read_text())
    assert scores["num_prompts"] == 4 and scores["eval/turns"] >= 1
