"""trainer.lora: peft adapters on a frozen base, merged weights for the engine, saves and exact resumes."""

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from flashreinforce.config import load_config
from flashreinforce.envs.single_turn import to_trajectory
from flashreinforce.models import build_model, token_logprobs
from flashreinforce.models.adapter_push import merged_state
from flashreinforce.models.numerics import Numerics
from flashreinforce.rollout.engine import Engine
from flashreinforce.run.learner import lora_settings
from flashreinforce.trainer.checkpoint import load_states, save_checkpoint
from flashreinforce.trainer.lora import LoraSettings
from flashreinforce.trainer.process import TrainerProcess, _layout, _map, _publish
from flashreinforce.trainer.trainer import OptimizerSettings, Trainer
from flashreinforce.types import (
    FORCED_VERSION,
    Prompt,
    RolloutKey,
    SamplingParams,
    Trajectory,
    Verdict,
)

VOCAB = 24
LORA = LoraSettings(r=4, alpha=8.0)
BENCHMARK = Path(__file__).resolve().parents[3] / "benchmarks" / "lora.py"
RUN = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
       "data.arithmetic.num_train=400",
       "data.arithmetic.num_eval=16", "data.arithmetic.digit_weights=[1.0]", "sft.steps=300", "sft.batch_size=16",
       "rollout.max_batch_size=16", "rollout.max_new_tokens=40", "scheduler.batch_groups=16", "trainer.steps=4",
       "trainer.microbatch_size=8", "trainer.checkpoint_every=2", "eval.num_prompts=8", "eval.k=2",
       "log.progress=false", "log.tensorboard=false", "verifier.min_workers=1", "verifier.max_workers=1",
       "trainer.lora={r: 4, alpha: 8}"]
"""A run of ~8 s whose one-digit sums the warm start half solves: the rewards vary, so the adapters train."""


def tiny(seed: int = 3, **shape) -> torch.nn.Module:
    return build_model(VOCAB, 32, 2, 4, 64, eos_token_id=1, pad_token_id=0, seed=seed, **shape)


def lora_trainer(model: torch.nn.Module, lora: LoraSettings | None = LORA, numerics: Numerics | None = None,
                 replay: bool = True) -> Trainer:
    return Trainer(model, loss="grpo", loss_options={}, microbatch_size=4, pad_token_id=0, temperature=1.0,
                   max_new_tokens=8, numerics=numerics, router_replay=replay, lora=lora,
                   optimizer=OptimizerSettings(lr=2e-2, weight_decay=0.01, betas=(0.9, 0.999), warmup_steps=0,
                                               total_steps=10, min_lr_ratio=1.0, grad_clip=1.0))


def batch(seed: int, rows: int = 8) -> list[Trajectory]:
    """Random rows in groups of 4 with mixed rewards (non-zero advantages, so every step moves the adapters)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(rows):
        n = 5 + int(torch.randint(0, 6, (1,), generator=g))
        tokens = tuple(int(t) for t in torch.randint(2, VOCAB, (n,), generator=g))
        mask = tuple(int(j >= 2) for j in range(n))
        reward = float((i + seed) % 2)
        out.append(Trajectory(
            key=RolloutKey(f"p{i // 4}", i % 4), prompt=Prompt(id=f"p{i // 4}", prompt="x", ground_truth="1"),
            group=i // 4, tokens=tokens, loss_mask=mask, behavior_logprobs=tuple(-3.0 * m for m in mask),
            policy_versions=tuple(0 if m else FORCED_VERSION for m in mask), prompt_length=2,
            finish_reason="stop", verdict=Verdict(reward=reward, passed=reward > 0)))
    return out


def trained(model: torch.nn.Module, steps: int = 3, **options) -> Trainer:
    trainer = lora_trainer(model, **options)
    for step in range(steps):
        trainer.step(batch(step))
    return trainer


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


IDS = torch.randint(2, VOCAB, (3, 12), generator=torch.Generator().manual_seed(9))


@pytest.mark.lora
def test_only_the_adapters_train_and_the_base_stays_frozen():
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = lora_trainer(model)
    adapters = {name: param.detach().clone() for name, param in trainer.lora.trainable}
    assert adapters and all(".lora_A." in name or ".lora_B." in name for name in adapters)
    assert [id(p) for p in trainer.masters.params] == [id(p) for _, p in trainer.lora.trainable]  # fp32: no copies
    stepped = sum(len(group["params"]) for group in trainer.optimizer.param_groups)
    assert stepped == len(adapters)
    for step in range(2):
        trainer.step(batch(step))
    for name, param in trainer.lora.trainable:
        assert not torch.equal(param, adapters[name]), name  # B starts at 0 and moves; A moves once B does
    live = trainer.lora.model.get_base_model().state_dict()
    for name, tensor in before.items():
        live_name = name if name in live else name.replace(".weight", ".base_layer.weight").replace(
            ".bias", ".base_layer.bias")
        assert torch.equal(live[live_name], tensor), name


@pytest.mark.lora
def test_merged_weights_compute_what_the_adapter_model_computes():
    base = tiny()
    plain = copy.deepcopy(base)
    trainer = trained(base)
    merged = trainer.weights()
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           plain.state_dict()["model.layers.0.self_attn.q_proj.weight"])
    plain.load_state_dict(merged, strict=True)
    torch.testing.assert_close(logits(plain, IDS), logits(trainer.model, IDS), rtol=0, atol=1e-5)
    for name, layer in trainer.lora._layers.items():  # the merge from tensors is peft's own delta, bit for bit
        expected = layer.base_layer.weight + layer.get_delta_weight("default")
        assert torch.equal(merged[f"{name}.weight"], expected), name


@pytest.mark.lora
def test_weights_have_the_base_models_names_and_shapes_and_leave_the_adapter_model_as_it_was():
    base = tiny()
    reference = copy.deepcopy(base).state_dict()
    trainer = trained(base, steps=1)
    before = logits(trainer.model, IDS)
    first, second = trainer.weights(), trainer.weights()
    assert list(first) == list(reference)
    assert all(first[k].shape == reference[k].shape and first[k].dtype == reference[k].dtype for k in reference)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert torch.equal(logits(trainer.model, IDS), before)  # merging wrote nothing into the live model
    assert not any(layer.merged for layer in trainer.lora._layers.values())


def _generate(engine: Engine, count: int) -> list:
    g = torch.Generator().manual_seed(5)
    for i in range(count):
        engine.submit(str(i), torch.randint(2, VOCAB, (5,), generator=g).tolist(),
                      SamplingParams(max_new_tokens=12, seed=i))
    finished = []
    while engine.has_work:
        finished += engine.step()
    return sorted(finished, key=lambda gen: int(gen.request_id))


def _rollouts(engine: Engine, count: int = 8) -> list[Trajectory]:
    return [to_trajectory(RolloutKey(f"q{i // 4}", i % 4), Prompt(f"q{i // 4}", "x", "y"), i // 4, gen,
                          Verdict(reward=float(i % 2), passed=bool(i % 2)))
            for i, gen in enumerate(_generate(engine, count))]


@pytest.mark.lora
def test_the_engine_loads_merged_weights_and_samples_the_trainers_log_probs():
    base = tiny()
    engine = Engine(copy.deepcopy(base), max_batch_size=4, max_context=64, eos_token_ids=1)
    trainer = trained(base)
    engine.load_weights(trainer.weights(), version=trainer.version)
    generations = _generate(engine, 4)
    trainer.model.eval()
    for gen in generations:
        ids = torch.tensor([gen.prompt_ids + gen.token_ids])
        with torch.no_grad():
            recomputed, _ = token_logprobs(trainer.model, ids, with_entropy=False)
        gap = (recomputed[0, len(gen.prompt_ids):] - torch.tensor(gen.behavior_logprobs)).abs().max()
        assert gap < 1e-4, (gen.request_id, float(gap))
    engine = Engine(copy.deepcopy(engine.model), max_batch_size=8, max_context=64, eos_token_ids=1,
                    version=trainer.version)
    metrics = trainer.step(_rollouts(engine))
    assert metrics["mismatch/same_weights_tokens"] == metrics["batch/policy_tokens"]
    assert metrics["mismatch/same_weights_abs_max"] < 1e-4


@pytest.mark.lora
def test_a_checkpoint_resumes_the_adapter_exactly_from_the_merged_model(tmp_path):
    """As a resume does: the model comes from the checkpoint's merged model/, the rest from trainer.pt."""
    trainer = trained(tiny(), steps=2)
    save_checkpoint(tmp_path, 2, write_model=trainer.save_model, trainer_state=trainer.state_dict(),
                    controller_state={}, meta={}, keep=1)
    state, _, _ = load_states(tmp_path / "step_000002")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "step_000002" / "model", dtype=torch.float32)
    resumed = lora_trainer(merged)
    resumed.load_state_dict(state)
    assert resumed.version == 2
    assert all(torch.equal(a, b) for a, b in zip(resumed.weights().values(), trainer.weights().values()))
    for step in (2, 3):
        ours, theirs = trainer.step(batch(step)), resumed.step(batch(step))
        assert ours["optim/grad_norm"] == theirs["optim/grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(resumed.weights().values(), trainer.weights().values()))
    assert state["lora"]["settings"] == {"r": 4, "alpha": 8.0, "rslora": False,
                                         "targets": list(trainer.lora.targets)}


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft reads a deprecated attribute
@pytest.mark.lora
def test_save_model_writes_a_merged_model_transformers_loads_and_the_adapter_alone(tmp_path):
    import peft

    base = tiny()
    original = copy.deepcopy(base)
    trainer = trained(base)
    trainer.save_model(tmp_path / "model")
    assert not (tmp_path / "model" / "adapter_config.json").exists()  # from_pretrained must not see an adapter
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    expected = logits(trainer.model, IDS)
    torch.testing.assert_close(logits(loaded, IDS), expected, rtol=0, atol=1e-5)
    out = loaded.generate(IDS[:1, :4], attention_mask=torch.ones(1, 4, dtype=torch.long), max_new_tokens=5,
                          do_sample=False, pad_token_id=0)
    assert out.shape == (1, 9)
    adapter = tmp_path / "model" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    alone = peft.PeftModel.from_pretrained(original, adapter)  # the adapter on the ORIGINAL base
    torch.testing.assert_close(logits(alone, IDS), expected, rtol=0, atol=1e-6)


@pytest.mark.lora
def test_the_adapter_push_fills_the_trainer_processs_shared_layout(tmp_path):
    """A TrainerProcess child publishes push_state() into a layout made from its base push: the base once, then the
    adapter alone after each step; the merged weights read from there are the trainer's own."""
    trainer = trained(tiny(), steps=1)
    slots, nbytes = _layout(trainer.push_state(base=True))
    (tmp_path / "weights").write_bytes(b"")
    shared = _map(str(tmp_path / "weights"), slots, nbytes)
    _publish(trainer, shared, base=True)
    trainer.step(batch(5))
    _publish(trainer, shared, base=False)  # the adapter and the probe; the frozen base stays as published
    own = trainer.push_state(base=True)
    assert list(shared) == list(own)
    assert all(torch.equal(shared[k], own[k]) for k in own)
    merged = trainer.weights()
    assert all(torch.equal(a, merged[k]) for k, a in merged_state(shared).items())


@pytest.mark.lora
@pytest.mark.slow  # a trainer process of its own
def test_a_trainer_process_publishes_the_base_once_and_then_the_adapter(one_thread):
    inline, remote = lora_trainer(tiny()), TrainerProcess(lora_trainer, (tiny(),), threads=1)
    try:
        for step in range(2):
            inline.step(batch(step))
            remote.step(batch(step))
        adapter = remote.push_state(base=False)
        assert set(adapter) == set(inline.push_state(base=False)) and not set(adapter) & set(inline.weights())
        assert set(inline.weights()) < set(remote.push_state(base=True))
        for name, tensor in inline.weights().items():  # merged in the parent from the published push
            torch.testing.assert_close(remote.weights()[name], tensor, rtol=0, atol=1e-6)
    finally:
        remote.close()


@pytest.mark.lora
def test_bf16_keeps_the_adapters_fp32_on_a_formatted_frozen_base():
    bf16 = Numerics("bf16")
    full = lora_trainer(tiny(), lora=None, numerics=bf16).weights()
    trainer = trained(tiny(), steps=1, numerics=bf16)
    assert all(param.dtype == torch.float32 for _, param in trainer.lora.trainable)
    assert trainer.masters.state_dict() == {}  # stepped directly: no masters to save
    merged = trainer.weights()
    assert {k: v.dtype for k, v in merged.items()} == {k: v.dtype for k, v in full.items()}
    assert torch.equal(merged["model.norm.weight"], full["model.norm.weight"])  # the same formatted base
    with pytest.warns(UserWarning, match="precision.mode=unified .* not by float rounding"):
        lora_trainer(tiny(), numerics=Numerics("bf16", unified=True))


@pytest.mark.lora
def test_moe_adapts_attention_and_the_shared_expert_and_freezes_routed_experts():
    moe = tiny(num_experts=4, experts_per_token=2)
    with torch.no_grad():
        for param in moe.parameters():
            param.mul_(3.0)  # peaked routers, so routes are well defined
    engine = Engine(copy.deepcopy(moe), max_batch_size=8, max_context=64, eos_token_ids=1)
    experts = {k: v.clone() for k, v in moe.state_dict().items() if ".experts." in k or k.endswith("mlp.gate.weight")}
    with pytest.warns(UserWarning, match="routed-expert stacks .* stay frozen"):
        trainer = lora_trainer(moe)
    leaves = {name.split(".layers.0.")[-1] for name in trainer.lora.targets if ".layers.0." in name}
    assert leaves == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"}
    metrics = trainer.step(_rollouts(engine))  # replays the engine's routes through the wrapped model
    assert metrics["mismatch/route_disagreement"] == 0.0 and metrics["mismatch/same_weights_abs_max"] < 1e-4
    merged = trainer.weights()
    assert list(merged) == list(engine.model.state_dict())
    assert all(torch.equal(merged[k], v) for k, v in experts.items())
    with pytest.warns(UserWarning):
        all_linear = lora_trainer(tiny(num_experts=4), lora=LoraSettings(target_modules="all-linear"))
    assert not any(name.endswith("shared_expert_gate") for name in all_linear.lora.targets)
    for target, reason in (("experts", "Qwen2MoeExperts"), ("gate_up_proj", "routed MoE experts")):
        with pytest.raises(ValueError, match=f"trainer.lora.target_modules: '{target}' .*{reason}"):
            lora_trainer(tiny(num_experts=4), lora=LoraSettings(target_modules=(target,)))


@pytest.mark.lora
def test_target_names_that_match_no_linear_layer_list_the_models_linear_layers():
    for target, reason in (("qkv", "matches no linear layer"), ("mlp", "Qwen2MLP"), ("lm_head", "output layer")):
        with pytest.raises(ValueError, match=f"trainer.lora.target_modules: '{target}' .*{reason}") as error:
            lora_trainer(tiny(), lora=LoraSettings(target_modules=("q_proj", target)))
        assert "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in str(error.value)


def test_a_missing_peft_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'flashreinforce\[lora\]'"):
        lora_trainer(tiny())


@pytest.mark.lora
def test_resuming_across_lora_settings_names_the_field():
    lora_state = lora_trainer(tiny()).state_dict()
    with pytest.raises(ValueError, match="trainer.lora: the checkpoint was written by LoRA"):
        lora_trainer(tiny(), lora=None).load_state_dict(lora_state)
    with pytest.raises(ValueError, match="trainer.lora: the checkpoint was written by full fine-tuning"):
        lora_trainer(tiny()).load_state_dict(lora_trainer(tiny(), lora=None).state_dict())
    with pytest.raises(ValueError, match="trainer.lora.r: this run has 8 .* trained with 4"):
        lora_trainer(tiny(), lora=LoraSettings(r=8, alpha=8.0)).load_state_dict(lora_state)
    with pytest.raises(ValueError, match="trainer.lora.target_modules: this run has 2 adapted layers"):
        lora_trainer(tiny(), lora=LoraSettings(r=4, alpha=8.0, target_modules=("q_proj",))).load_state_dict(
            lora_state)


def test_the_config_validates_lora_and_names_the_field():
    config = load_config(None, ["trainer.lora={}", "seed=7"])
    settings = lora_settings(config)
    assert (settings.r, settings.alpha, settings.dropout, settings.seed) == (16, 32.0, 0.0, 7)
    assert settings.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert lora_settings(load_config(None, [])) is None  # the default: full fine-tuning
    assert lora_settings(load_config(None, ["trainer.lora.target_modules=all-linear"])).target_modules == "all-linear"
    for override, message in (("trainer.lora.r=0", "trainer.lora.r: Input should be greater"),
                              ("trainer.lora.target_modules=q_proj", "trainer.lora.target_modules: .*single name"),
                              ("trainer.lora.target_modules=[]", "trainer.lora.target_modules: .*at least one"),
                              ("trainer.lora.dropout=1.5", "trainer.lora.dropout: Input should be less"),
                              ("trainer.lora.rank=8", "trainer.lora.rank: unknown field")):
        with pytest.raises(ValueError, match=message):
            load_config(None, [override])
    for bad, field in (({"r": 0}, "r"), ({"alpha": 0.0}, "alpha"), ({"dropout": 1.0}, "dropout"),
                       ({"target_modules": "q_proj"}, "target_modules"), ({"target_modules": ()}, "target_modules")):
        with pytest.raises(ValueError, match=f"trainer.lora.{field}"):
            LoraSettings(**bad)


@pytest.mark.lora
@pytest.mark.slow
def test_the_benchmark_quick_run_reports_both_configurations_and_both_pushes(tmp_path):
    out = tmp_path / "lora.json"
    subprocess.run([sys.executable, str(BENCHMARK), "--quick", "--json", str(out)], check=True, timeout=300)
    report = json.loads(out.read_text())
    rows = {row["method"]: row for row in report["rows"]}
    assert set(rows) == {"full", "lora"}
    assert rows["lora"]["trainable_params"] < rows["full"]["trainable_params"]
    assert all(row["step_seconds"] > 0 and row["peak_rss_mb"] > 0 for row in rows.values())
    pushes = {(row["r"], row["push"]): row for row in report["pushes"]}
    assert set(pushes) == {(r, push) for r in (4, 8) for push in ("merged", "adapter")}
    for r in (4, 8):  # the adapter alone carries a fraction of the merged model's bytes
        assert pushes[r, "adapter"]["MB"] < pushes[r, "merged"]["MB"] / 2
        for push in ("merged", "adapter"):
            row = pushes[r, push]
            assert row["push s"] == pytest.approx(row["trainer s"] + row["engine s"])
    assert pushes[4, "adapter"]["MB"] < pushes[8, "adapter"]["MB"]


def _train(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "flashreinforce", "train", *argv], check=True, timeout=300,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.lora
@pytest.mark.slow
def test_a_deterministic_lora_run_resumed_midway_ends_with_the_straight_runs_weights(tmp_path):
    """The whole path: learner -> Trainer, checkpoints of the merged model, a resume that rebuilds from them."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train("--output", str(straight), *RUN, "--deterministic")
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")  # as if killed after the step-2 checkpoint
    (resumed / "summary.json").unlink()
    _train("--resume", str(resumed))
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        ours, theirs = (load_file(run / "checkpoints" / "step_000004" / "model" / name) for run in (straight, resumed))
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name
    adapter = load_file(straight / "checkpoints" / "step_000004" / "model" / "adapter" / "adapter_model.safetensors")
    assert max(float(v.abs().max()) for k, v in adapter.items() if "lora_B" in k) > 0  # it trained
