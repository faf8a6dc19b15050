"""scripts/alfworld_data.py writes the files the alfworld recipe reads, from ALFWorld's game folders."""

import json
import subprocess
import sys
from pathlib import Path

from flashreinforce.cli import main
from flashreinforce.data.loaders import load_prompts

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "alfworld_data.py"


def test_the_script_writes_the_recipes_train_and_held_out_games(tmp_path, monkeypatch, capsys):
    games = tmp_path / "alfworld"
    for split, count in (("train", 3), ("valid_seen", 2), ("valid_unseen", 1)):
        for i in range(count):
            game = games / "json_2.1.1" / split / f"look_at_obj_in_light-Book-{i}" / "trial_1" / "game.tw-pddl"
            game.parent.mkdir(parents=True)
            game.write_text(json.dumps({"solvable": True}))
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "data"), "--data-dir", str(games)],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    train = load_prompts(tmp_path / "data" / "alfworld_train.jsonl").prompts
    held_out = load_prompts(tmp_path / "data" / "alfworld_eval.jsonl").prompts
    assert [p.ground_truth for p in train] == [
        f"json_2.1.1/train/look_at_obj_in_light-Book-{i}/trial_1/game.tw-pddl" for i in range(3)]
    assert [p.ground_truth.split("/")[1] for p in held_out] == ["valid_seen", "valid_seen", "valid_unseen"]
    assert all((games / p.ground_truth).is_file() and p.data_source == "alfworld" for p in [*train, *held_out])
    monkeypatch.chdir(tmp_path)  # the recipe's relative paths: data/alfworld_*.jsonl
    main(["train", "alfworld", "backend.kind=local", "rollout.engine=local", "--dry-run"])
    assert "dry run: checked the run" in capsys.readouterr().err
