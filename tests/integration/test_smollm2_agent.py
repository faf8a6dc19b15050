"""The smollm2_agent recipe's mechanics end to end, with tiny settings, on the real model: the warm stage runs
examples/python_tool_agent.py through the endpoint against demonstrations (its tool's code in the sandbox), the
warmed model keeps the Hermes template, RL trains the agent's episodes, and the trained model served by
`flashreinforce serve` answers the same file run with the plain `openai` client.

Skipped, naming the command, without the converted model (`flashreinforce models get smollm2-135m-instruct`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashreinforce.endpoint.chat import HERMES_TEMPLATE
from flashreinforce.models import store
from flashreinforce.sandbox import probe_isolation
from serving import served

pytestmark = [pytest.mark.slow, pytest.mark.endpoint]

REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / "examples" / "python_tool_agent.py"
TINY = ["stages.0.steps=2", "sft.batch_size=4", "stages.1.steps=2", "scheduler.batch_groups=4",
        "trainer.microbatch_size=4", "trainer.checkpoint_every=1", "data.tool_multiply.num_train=40",
        "data.tool_multiply.num_eval=4", "eval.num_prompts=4", "log.progress=false", "log.tensorboard=false",
        "verifier.min_workers=1", "verifier.max_workers=1", "env.max_workers=1", "backend.torch_threads=1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    cached = store.find("smollm2-135m-instruct")
    if cached.problem is not None:
        pytest.skip(f"needs the converted model ({cached.path} {cached.problem}): run "
                    "`flashreinforce models get smollm2-135m-instruct` first")
    if probe_isolation() == "none":
        pytest.skip("the agent's tool runs in the sandbox, and no sandbox works here (apt-get install bubblewrap)")
    run_dir = tmp_path_factory.mktemp("smollm2_agent") / "run"
    command = [sys.executable, "-m", "flashreinforce", "train", "smollm2_agent", "--output", str(run_dir), *TINY]
    # from the checkout: env.agent is a path relative to the working directory
    done = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return run_dir


def test_the_warm_start_and_rl_train_the_agent_file_and_the_models_keep_the_tool_template(trained):
    summary = json.loads((trained / "summary.json").read_text())
    assert [s["kind"] for s in summary["stages"]] == ["sft", "rl"]
    assert summary["optimizer_steps"] == 2 and summary["trained_trajectories"] == 8
    final = max((trained / "stages" / "02-rl" / "checkpoints").glob("step_*")) / "model"
    for model in (trained / "stages" / "01-warm" / "sft", final):
        assert (model / "chat_template.jinja").read_text() == HERMES_TEMPLATE
    samples = [json.loads(line) for line in (trained / "stages" / "02-rl" / "samples.jsonl").read_text().splitlines()]
    assert samples and all('<tools>\n{"type": "function", "function": {"name": "python"' in s["prompt"]
                           and s["prompt"].endswith("?<|im_end|>\n<|im_start|>assistant\n") for s in samples)
    rows = [json.loads(line) for line in (trained / "stages" / "02-rl" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss/policy" in row]
    assert steps[-1]["endpoint/calls"] >= steps[-1]["episode/end/done"] > 0


def test_the_same_agent_file_runs_against_the_served_model_with_the_plain_openai_client(trained):
    with served(trained, "--api-key", "local") as (url, _):
        done = subprocess.run([sys.executable, str(AGENT), "--base-url", url, "--api-key", "local", "--questions", "2"],
                              check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 3 and lines[-1] in ("correct: 0/2", "correct: 1/2", "correct: 2/2"), done.stdout
