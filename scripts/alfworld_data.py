"""Write the alfworld recipe's data files from ALFWorld's games (`pip install alfworld && alfworld-download`, then
ALFWORLD_DATA set to the folder it filled):

    python scripts/alfworld_data.py data     # data/alfworld_train.jsonl, data/alfworld_eval.jsonl

Training: the first 1,024 games of the train split (the reference setting trains 20 passes of 64 games a step over
1,024 games). Held out: every game of valid_seen and valid_unseen (140 + 134). One row a game in the common RL
format (docs/data.md), its ground truth the game's path under ALFWORLD_DATA, which the alfworld environment plays.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flashreinforce.envs.textworld_env import alfworld_prompts
from flashreinforce.types import Prompt

TRAIN_GAMES = 1024


def row(prompt: Prompt) -> dict:
    return {"id": prompt.id, "prompt": prompt.prompt, "reward_model": {"ground_truth": prompt.ground_truth},
            "data_source": prompt.data_source}


def write_rows(path: Path, prompts: list[Prompt]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row(p)) + "\n" for p in prompts))
    print(f"{path}: {len(prompts)} games")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="directory for alfworld_train.jsonl and alfworld_eval.jsonl")
    parser.add_argument("--data-dir", help="ALFWorld's data folder (default $ALFWORLD_DATA)")
    args = parser.parse_args()
    write_rows(args.out / "alfworld_train.jsonl", alfworld_prompts("train", data_dir=args.data_dir, n=TRAIN_GAMES))
    held_out = [p for split in ("valid_seen", "valid_unseen") for p in alfworld_prompts(split, data_dir=args.data_dir)]
    write_rows(args.out / "alfworld_eval.jsonl", held_out)


if __name__ == "__main__":
    main()
