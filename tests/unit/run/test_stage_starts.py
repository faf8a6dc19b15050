"""Where each stage of a pipeline starts: the previous stage's weights, or with `from: NAME` that earlier stage's
(its weights and the trainer state that goes with them), while steps go on counting and every earlier stage's model
is there for a distill stage's teachers. The stages themselves are stand-ins that record what they were given."""

import shutil
from pathlib import Path

import pytest

from flashreinforce.config import load_config
from flashreinforce.metrics.console import Reporter
from flashreinforce.run import stages as stages_module
from flashreinforce.trainer.checkpoint import save_checkpoint

PIPELINE = ("stages=[{name: warm, kind: sft, steps: 5}, {name: a, steps: 3, tasks: {sums: {}}},"
            " {name: b, from: warm, steps: 3, tasks: {tool: {}}, optimizer: reset},"
            " {name: c, kind: sft, from: a, steps: 5},"
            " {name: d, kind: distill, from: a, steps: 2, tasks: {sums: {}, tool: {}},"
            " teachers: {sums: {stage: a}, tool: {stage: b}}}]")
SMALL = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.vision=null",
         "tasks.most.data.vision.num_train=10"]


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    calls = {}

    def sft_stage(config, directory, model_dir, name, version, reporter):
        calls[name] = {"model_dir": model_dir, "version": version}
        (directory / "sft").mkdir(parents=True)
        return {"stage": name, "first_step": version, "optimizer_steps": version, "final_accuracy": 0.0}

    def run_rl_stage(config, directory, resume, reporter, start):
        calls[start.name] = {"start": start, "loss": config.algo.loss, "teachers": config.teachers}
        version = start.first_version + config.trainer.steps
        initial = directory.parent.parent / "initial"  # any intact model will do
        save_checkpoint(directory / "checkpoints", version, write_model=lambda path: shutil.copytree(initial, path),
                        trainer_state={"version": version, "optimizer": {"moments": start.name}, "schedule": {},
                                       "torch_rng": None},
                        controller_state={"version": version, "inflight": [], "scheduler": {
                            "kind": "stream", "options": {}, "ledger": {},
                            "book": {"next_sample": {f"{start.name}/p": version}}}},
                        meta={"wall_seconds": 0.0}, keep=1)
        return {"optimizer_steps": version, "final_accuracy": 0.0, "data_positions": {}}

    monkeypatch.setattr(stages_module, "sft_stage", sft_stage)
    config = load_config("multitask", [PIPELINE, *SMALL])
    stages_module.run_stages(config, tmp_path / "run", False, Reporter(enabled=False), run_rl_stage)
    return calls, tmp_path / "run" / "stages"


def test_a_stage_from_an_earlier_one_starts_from_its_weights_and_goes_on_counting_steps(recorded):
    calls, stages = recorded
    warm, a_final = stages / "01-warm" / "sft", stages / "02-a" / "checkpoints" / "step_000003" / "model"
    assert calls["a"]["start"].model_dir == warm and calls["a"]["start"].trainer_state is None
    b = calls["b"]["start"]  # from warm, not from a: a's weights and moments stay a's
    assert b.model_dir == warm and b.first_version == 3 and b.trainer_state == {"version": 3}
    assert b.next_samples == {"a/p": 3}, "keys go on numbering from the last RL stage, whatever the start"
    assert calls["c"] == {"model_dir": a_final, "version": 6}  # an sft stage from a


def test_a_distill_stage_takes_its_start_and_the_earlier_stages_as_teachers(recorded):
    calls, stages = recorded
    d = calls["d"]["start"]
    a_final = stages / "02-a" / "checkpoints" / "step_000003" / "model"
    assert d.model_dir == a_final and d.first_version == 6
    # a's AdamW moments (optimizer: keep) with the pipeline's step count, not a's own 3
    assert d.trainer_state == {"version": 6, "optimizer": {"moments": "a"}}
    assert d.stage_models == {"warm": stages / "01-warm" / "sft", "a": a_final,
                              "b": stages / "03-b" / "checkpoints" / "step_000006" / "model",
                              "c": stages / "04-c" / "sft"}
    assert calls["d"]["loss"] == "opd" and {t: v.stage for t, v in calls["d"]["teachers"].items()} == {
        "sums": "a", "tool": "b"}
    assert calls["a"]["teachers"] is None  # an rl stage has none


def test_resolving_a_distill_stages_teachers_names_each_stages_model(recorded, tmp_path):
    from flashreinforce.run.distill import resolve_teachers

    calls, _ = recorded
    d = calls["d"]
    config = load_config("multitask", [PIPELINE, *SMALL]).stage(4)
    resolved = resolve_teachers(config, d["start"].stage_models)
    assert {task: Path(teacher.path) for task, teacher in resolved.teachers.items()} == {
        "sums": d["start"].stage_models["a"], "tool": d["start"].stage_models["b"]}
    with pytest.raises(ValueError, match=r"teachers\.sums\.stage=a: .*only inside a pipeline"):
        resolve_teachers(config, {})
