import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from flashreinforce.models import build_model, load_model, resolve_dtype
from flashreinforce.models.causal_lm import disable_dropout
from flashreinforce.models.checkpointing import checkpoint_layers


def test_build_model_is_a_seeded_qwen2_that_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(vocab_size=20, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64, seed=7)
    assert torch.rand(1) == expected_next  # building did not consume the caller's random stream
    b = build_model(vocab_size=20, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64, seed=7)
    c = build_model(vocab_size=20, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64, seed=8)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, c.model.layers[0].mlp.up_proj.weight)
    assert a.config.model_type == "qwen2" and a.config.num_hidden_layers == 2
    assert a.config.intermediate_size == 4 * 32 and a.config._attn_implementation == "sdpa"
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied by default
    assert a.dtype == torch.float32


def test_saved_model_loads_back_with_identical_outputs(tmp_path):
    model = build_model(vocab_size=16, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=0)
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    ids = torch.tensor([[1, 5, 3, 2]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert load_model(tmp_path, dtype="bf16").dtype == torch.bfloat16


def test_bad_arguments_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="num_heads"):
        build_model(vocab_size=16, hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_model(vocab_size=16, hidden_size=32, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="eos_token_id"):
        build_model(vocab_size=16, eos_token_id=16)
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="float64x"):
        resolve_dtype("float64x")


def test_a_missing_model_path_is_named_before_any_hub_lookup(tmp_path):
    from flashreinforce.run.policy import build_policy
    from flashreinforce.config import load_config

    missing = tmp_path / "no-such-model"
    config = load_config(None, [f"model.path={missing}"])
    # Before the fix the tokenizer loader ran first and raised an OSError about a Hub repo id.
    with pytest.raises(ValueError, match=rf"model\.path '{missing}' does not exist: it must be a local directory"):
        build_policy(config, None, tmp_path / "run", None)


def test_a_model_dir_with_a_damaged_file_names_the_file(tmp_path):
    build_model(vocab_size=16, hidden_size=16, num_layers=1, num_heads=2, seed=0).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[: len(intact) - 100])
    with pytest.raises(ValueError, match=r"model\.safetensors is damaged or truncated .*; restore it"):
        load_model(tmp_path)
    weights.write_bytes(intact)
    (tmp_path / "config.json").write_text('{"model_type": "qwen2",')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_model(tmp_path)


def test_disable_dropout_turns_off_dropout_layers_and_attention_dropout():
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=16, n_embd=16, n_layer=1, n_head=2, n_positions=8))
    llama = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                                                          num_hidden_layers=1, num_attention_heads=2,
                                                          attention_dropout=0.3))
    ids = torch.tensor([[1, 2, 3, 4]])
    for model in (gpt2, llama):
        model.train()
        with torch.no_grad():
            assert not torch.equal(model(ids).logits, model(ids).logits)  # dropout draws differ
        disable_dropout(model)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, model(ids).logits)
        assert model.training


def test_layers_are_checkpointed_under_either_name_transformers_gave_the_switch():
    model = build_model(vocab_size=16, hidden_size=16, num_layers=1, num_heads=2, seed=0)
    checkpoint_layers(model, {"use_reentrant": False})  # this transformers: activation_checkpointing_enable
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    calls = []

    class OlderTransformersModel(torch.nn.Module):  # before 5.24 the switch had only its first name
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            calls.append(gradient_checkpointing_kwargs)

    checkpoint_layers(OlderTransformersModel(), {"use_reentrant": False})
    assert calls == [{"use_reentrant": False}]
