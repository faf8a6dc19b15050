"""Tiny models of the families the local engine serves (flashreinforce/models/families.py), each built from its
transformers config with no hub: 4 layers, hidden 32, a sliding window of WINDOW tokens where the family has one
(on every layer, or on some: Gemma's alternating local/global layers, Qwen's upper layers), experts where it has
them. Tests of the engine, router replay and the run parametrize over FAMILY_NAMES."""

from __future__ import annotations

import torch
import transformers as tf

from flashreinforce.models.families import FAMILIES
from flashreinforce.models.moe import init_zero_routers

VOCAB = 64
WINDOW = 5
_BASE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128}
_MLA = {"num_key_value_heads": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 16, "n_group": 2, "topk_group": 1}
_CONFIGS = {
    "gpt2": lambda: tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128),
    "llama": lambda: tf.LlamaConfig(**_BASE),
    "gemma": lambda: tf.GemmaConfig(**_BASE, head_dim=8),
    "mistral": lambda: tf.MistralConfig(**_BASE, sliding_window=WINDOW),
    "phi3": lambda: tf.Phi3Config(**_BASE, sliding_window=WINDOW),
    # full attention on layers below max_window_layers, the window above
    "qwen2": lambda: tf.Qwen2Config(**_BASE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    "qwen3": lambda: tf.Qwen3Config(**_BASE, head_dim=8, use_sliding_window=True, sliding_window=WINDOW,
                                    max_window_layers=1),
    # local, global, local, global (Gemma 2's pattern; Gemma 3's every 6th layer global, here every 2nd)
    "gemma2": lambda: tf.Gemma2Config(**_BASE, head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8),
    "gemma3_text": lambda: tf.Gemma3TextConfig(**_BASE, head_dim=8, sliding_window=WINDOW, sliding_window_pattern=2,
                                               query_pre_attn_scalar=8),
    "mixtral": lambda: tf.MixtralConfig(**_BASE, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(**_BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                           shared_expert_intermediate_size=32, use_sliding_window=True,
                                           sliding_window=WINDOW, max_window_layers=2),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**_BASE, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=16, use_sliding_window=True, sliding_window=WINDOW),
    "olmoe": lambda: tf.OlmoeConfig(**_BASE, num_experts=4, num_experts_per_tok=2),
    # shared experts beside the routed ones, a dense first layer, grouped choice, multi-head latent attention
    "deepseek_v2": lambda: tf.DeepseekV2Config(**(_BASE | _MLA), n_routed_experts=4, num_experts_per_tok=2,
                                               q_lora_rank=None, topk_method="group_limited_greedy"),
    "deepseek_v3": lambda: tf.DeepseekV3Config(**(_BASE | _MLA), n_routed_experts=8, num_experts_per_tok=2,
                                               q_lora_rank=16),
    "dbrx": lambda: tf.DbrxConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=128,
                                  attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                                  ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}),
    "gpt_oss": lambda: tf.GptOssConfig(**_BASE, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                       sliding_window=WINDOW, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 10000.0}),
}
FAMILY_NAMES = sorted(_CONFIGS)
"""Every family of FAMILIES but the vision-language models' language models (their own tests cover those)."""
MOE_FAMILIES = ("dbrx", "deepseek_v2", "deepseek_v3", "gpt_oss", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe")
REPLAYED_FAMILIES = tuple(name for name in MOE_FAMILIES if name != "dbrx")
"""DBRX chooses its experts where no hook reaches: served and trained without router replay."""
WINDOWED_FAMILIES = ("gemma2", "gemma3_text", "gpt_oss", "mistral", "mixtral", "phi3", "qwen2", "qwen2_moe", "qwen3",
                     "qwen3_moe")
assert set(FAMILIES) == {*FAMILY_NAMES, "qwen2_vl_text", "qwen2_5_vl_text"}, "every served family has a tiny model"


def family_config(name: str, vocab_size: int = VOCAB, pad_token_id: int = 0, eos_token_id: int = 1,
                  **overrides) -> tf.PreTrainedConfig:
    config = _CONFIGS[name]()
    for key, value in dict(vocab_size=vocab_size, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                           bos_token_id=None, **overrides).items():
        setattr(config, key, value)
    return config


def tiny_family_model(name: str, seed: int = 0, **config_kwargs) -> tf.PreTrainedModel:
    """A seeded random model of the family (its routers randomised too: zeros would tie every expert), fp32, with
    the attention implementation transformers picks (sdpa; eager for Gemma 2 and GPT-OSS)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(family_config(name, **config_kwargs))
        init_zero_routers(model)
    return model.eval()
