"""Qwen3 dense (model_type qwen3): its HF config read into a ModelSpec, and its Megatron-Core GPTModel mapping.

Qwen3 drops Qwen2's q/k/v biases and normalises each head's queries and keys (RMSNorm over head_dim): Megatron-Core's
`qk_layernorm`. qwen3_moe.py builds on what is declared here.
"""

from toolkit.families.family import Family, HFConfig
from toolkit.families.lineage import DENSE_MLP_WEIGHTS, LLAMA_FIXED, LLAMA_WEIGHTS, llama_megatron_fields, llama_spec
from toolkit.families.mapping import MegatronMapping, Rename, Unsupported


def read(cfg: HFConfig, **moe) -> dict:
    bias = cfg.flag("attention_bias")  # biases o_proj too
    return llama_spec(cfg, qkv_bias=bias, attn_out_bias=bias, qk_norm=True, **moe)


CONFIG = llama_megatron_fields(eps_default=1e-6, theta_default=10000.0)

FIXED = {**LLAMA_FIXED, "transformer_config.qk_layernorm": True}

UNSUPPORTED = (
    Unsupported("attention_bias", bool, "Qwen3 with attention_bias also biases o_proj, which Megatron-Core only "
                                        "biases together with the MLP"),
    Unsupported("use_sliding_window", bool, "per-layer sliding windows have no Megatron-Core equivalent here"),
)

ATTN_NORMS = (
    Rename("model.layers.{layer}.self_attn.q_norm.weight", "decoder.layers.{layer}.self_attention.q_layernorm.weight"),
    Rename("model.layers.{layer}.self_attn.k_norm.weight", "decoder.layers.{layer}.self_attention.k_layernorm.weight"),
)

# Qwen3Config: head_dim defaults to 128 (not hidden/heads), num_key_value_heads may be null
FAMILY = Family("qwen3", read, MegatronMapping("Qwen3ForCausalLM", CONFIG, FIXED, UNSUPPORTED,
                                               LLAMA_WEIGHTS + ATTN_NORMS + DENSE_MLP_WEIGHTS),
                nullable=frozenset({"num_key_value_heads"}))
