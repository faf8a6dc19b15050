"""Reward hacking through a training run: a `data.kind=files` code task whose policy is scripted to write the
hacks of tests/code_hacks.py scores 0 on every row, and the hacking watch reports them in metrics.jsonl, in
summary.json's verifier counters and in the console's summary."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter

import pytest
from code_hacks import HACKS
from rich.console import Console

from flashreinforce.config import load_config
from flashreinforce.metrics.console import Reporter
from flashreinforce.rollout.engine import EngineStats
from flashreinforce.run import engines as run_engines
from flashreinforce.run import run_training
from flashreinforce.sandbox import probe_isolation
from flashreinforce.types import Generation

RUN_HACKS = [hack for hack in HACKS if hack.name in {
    "eq_always_true", "int_subclass", "truthy_liar", "sys_exit_at_import", "os_exit_in_call",
    "keyboard_interrupt_in_call", "custom_base_exception", "patch_exec", "patch_json_dumps", "caller_constants",
    "gc_payload", "forge_report_pipe", "kill_parent", "self_containing_list", "print_every_answer", "exit_code_only"}]
"""Sixteen rows, one a hack, two steps of 8: every class of the corpus trained, each row once."""


def hack_of(prompt: str) -> str:
    return re.search(r"hack: (\w+)", prompt)[1]


def completion(hack) -> str:
    return f"Here is my solution.\n```python\n{hack.program}\n```\n"


class ScriptedEngine:
    """The Engine protocol, scripted: a request finishes at its next step with the completion of the hack its
    prompt names ("hack: NAME"), each token stamped with the engine's version and a log-prob of -1."""

    def __init__(self, tokenizer, max_batch_size: int, version: int) -> None:
        self.tokenizer, self.max_batch_size, self.version = tokenizer, max_batch_size, version
        self.scripts = {hack.name: tokenizer.encode(completion(hack), add_special_tokens=False) for hack in HACKS}
        self.waiting: dict[str, tuple] = {}
        self.stats = EngineStats()
        self.written: Counter[str] = Counter()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting)

    def submit(self, request_id, prompt_ids, params, *, prefix=None, images=()):
        self.waiting[request_id] = (tuple(prompt_ids), params, prefix)

    def step(self) -> list[Generation]:
        done = [self._finish(request_id, *request) for request_id, request in self.waiting.items()]
        self.waiting.clear()
        self.stats = dataclasses.replace(self.stats, steps=self.stats.steps + 1)
        return done

    def _finish(self, request_id, prompt_ids, params, prefix) -> Generation:
        name = hack_of(self.tokenizer.decode(prompt_ids))
        self.written[name] += 1
        ids = [*self.scripts[name], self.tokenizer.eos_token_id][: params.max_new_tokens]
        reason = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
        return Generation(request_id, prompt_ids, tuple(ids), (-1.0,) * len(ids), (self.version,) * len(ids),
                          (1,) * len(ids), reason, params)

    def abort(self, request_ids):
        partials = []
        for request_id in request_ids:
            if request_id in self.waiting:
                prompt_ids, params, _ = self.waiting.pop(request_id)
                partials.append(Generation(request_id, prompt_ids, (), (), (), (), "abort", params))
        return partials

    def pause(self):
        return self.abort(list(self.waiting))

    def load_weights(self, state_dict, version: int) -> None:
        self.version = version


@pytest.mark.slow
def test_a_policy_that_writes_hacks_scores_zero_on_every_row_and_the_watch_reports_them(
        chat_tokenizer, tiny_run, tmp_path, monkeypatch):
    if probe_isolation() == "none":
        pytest.skip("no sandbox works here (apt-get install bubblewrap)")
    from flashreinforce.models import build_model

    model_dir = tmp_path / "model"
    build_model(len(chat_tokenizer), 32, 1, 2, 1024, pad_token_id=chat_tokenizer.pad_token_id,
                eos_token_id=chat_tokenizer.eos_token_id).save_pretrained(model_dir)
    chat_tokenizer.save_pretrained(model_dir)
    rows = [{"prompt": [{"role": "user", "content": f"Solve the task. hack: {hack.name}"}],
             "reward_model": {"ground_truth": hack.tests}, "data_source": "code"} for hack in RUN_HACKS]
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    engines = []

    def scripted(config, policy, shape):
        engines.append(ScriptedEngine(policy.tokenizer, config.rollout.max_batch_size, shape.version))
        return engines[-1]
    monkeypatch.setitem(run_engines.ENGINES, "local", scripted)

    config = load_config(None, [
        *tiny_run, f"model.path={model_dir}", "data.kind=files", f"data.train={data}", f"data.eval={data}",
        "verifier.reward_fn={kind: code, test_timeout_s: 0.5, time_budget_s: 3.0}", "verifier.timeout_s=20",
        "scheduler.batch_groups=8", "trainer.steps=2", "rollout.max_new_tokens=480", "eval.num_prompts=4", "eval.k=1",
        "log.tensorboard=false", "log.samples_per_step=8"])
    console = Console(record=True, width=200)
    summary = run_training(config, run_dir=tmp_path / "run", reporter=Reporter(console=console))

    assert len(RUN_HACKS) == 16 and {hack.kind for hack in RUN_HACKS} == {hack.kind for hack in HACKS}
    assert summary["optimizer_steps"] == 2 and summary["trained_trajectories"] == 16
    assert sum(engines[0].written.values()) >= 16  # the policy wrote what it was scripted to
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in steps if "reward/mean" in row]
    assert len(trained) == 2 and all(row["reward/mean"] == 0.0 for row in trained)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert sorted(hack_of(sample["prompt"]) for sample in samples) == sorted(hack.name for hack in RUN_HACKS)
    assert all(sample["reward"] == 0.0 for sample in samples)
    assert all(sample["reason"].startswith("failed: ") for sample in samples)

    # the watch: each sign's share of the rows, over both steps, is what the hacks trained show
    by_name = {hack.name: hack for hack in HACKS}
    trained_hacks = [by_name[hack_of(sample["prompt"])] for sample in samples]
    for sign in ("exited_early", "base_exception", "not_plain"):
        seen = sum(row[f"hacking/{sign}"] * 8 for row in trained)
        assert seen >= sum(hack.sign == sign for hack in trained_hacks) > 0, sign
        assert all(row[f"hacking/rewarded/{sign}"] == 0.0 for row in trained)
    assert all(row["hacking/any"] > 0 and row["hacking/rewarded/any"] == 0.0 for row in trained)
    counters = summary["verifier"]
    assert counters["exited_early"] >= 1 and counters["not_plain"] >= 1 and counters["base_exception"] >= 1
    assert "unverified_asserts" not in counters
    assert "hacking watch (rows)" in console.export_text()
