"""A whole run whose environment's reset raises for some prompts: those episodes end as `env_error`,
are recorded dropped in the exactly-once ledger, and the run (and a resume of it) goes on."""

from __future__ import annotations

import json
import textwrap

import pytest

from flashreinforce.config import config_from_tree, load_config
from flashreinforce.run.directory import read_run_config
from flashreinforce.run.training import run_training

pytestmark = pytest.mark.slow  # a tiny run and its resume, ~8 s

FLAKY_ENV = textwrap.dedent('''
    import zlib


    class FlakyReset:
        """One turn, scored by the run's verifier; reset raises, every time, for about one prompt in two."""

        def reset(self, prompt, seed):
            if zlib.crc32(prompt.id.encode()) % 2 == 0:
                raise ValueError(f"no environment for {prompt.id}")
            return ""

        def step(self, action):
            return "", 0.0, True, {}

        def close(self):
            pass
''')


@pytest.mark.parametrize("scheduler", [["scheduler.kind=stream"],
                                       ["scheduler.kind=urb", "scheduler.buffer_size=2", "scheduler.batch_groups=4",
                                        "scheduler.group_size=2", "algo.loss=grpo"]],
                         ids=["stream", "urb-grpo"])
def test_a_raising_reset_drops_its_episode_as_env_error_and_the_run_and_its_resume_go_on(tiny_run, scheduler, tmp_path):
    (tmp_path / "flaky_env.py").write_text(FLAKY_ENV)
    run_dir = tmp_path / "run"
    config = load_config(None, [*tiny_run, f"env.kind={tmp_path / 'flaky_env.py'}:FlakyReset", "env.max_workers=1",
                                "env.max_prompt_tokens=16", "trainer.steps=2", *scheduler])
    summary = run_training(config, run_dir=run_dir)  # checks the exactly-once ledger at the end
    assert summary["optimizer_steps"] == 2
    dropped = summary["dropped_trajectories"].get("env_error", 0)
    assert dropped > 0, summary["dropped_trajectories"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/policy" in r]
    assert steps[-1]["buffer/dropped_env_error"] == dropped and steps[-1]["episode/end/env_error"] >= dropped

    # The failure is deterministic: the resumed run meets it again on new prompts, and goes on.
    resumed = config_from_tree(read_run_config(run_dir), ["trainer.steps=4"])
    summary = run_training(resumed, run_dir=run_dir, resume=True)
    assert summary["optimizer_steps"] == 4
    assert summary["dropped_trajectories"]["env_error"] > dropped
