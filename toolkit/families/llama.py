"""Llama (model_type llama): its HF config read into a ModelSpec, and its Megatron-Core GPTModel mapping."""

from toolkit.families.family import Family, HFConfig
from toolkit.families.lineage import (
    DENSE_MLP_WEIGHTS,
    LLAMA_FIXED,
    LLAMA_WEIGHTS,
    llama_megatron_fields,
    llama_spec,
    rope_scaling_enabled,
    rope_scaling_factor,
)
from toolkit.families.mapping import Field, MegatronMapping, Unsupported


def read(cfg: HFConfig) -> dict:
    cfg.heads_divide_hidden(cfg.integer("hidden_size"), cfg.integer("num_attention_heads"))
    bias = cfg.flag("attention_bias")  # LlamaAttention biases o_proj too
    return llama_spec(cfg, qkv_bias=bias, attn_out_bias=bias, mlp_bias=cfg.flag("mlp_bias"))


CONFIG = llama_megatron_fields(eps_default=1e-6, theta_default=10000.0) + (
    # Llama 3.1's frequency scaling is Megatron-Core's `rope_scaling`; the converter writes the HF dict back itself
    Field("rope_scaling", "gpt_model.rope_scaling", None, rope_scaling_enabled, to_hf=False),
    Field("rope_scaling", "gpt_model.rope_scaling_factor", None, rope_scaling_factor, to_hf=False),
)

UNSUPPORTED = (
    Unsupported("attention_bias", bool, "Llama's attention_bias also biases o_proj, which Megatron-Core only biases "
                                        "together with the MLP (add_bias_linear); train without attention bias"),
    Unsupported("mlp_bias", bool, "MLP biases without attention-output biases have no Megatron-Core equivalent"),
)

# LlamaConfig: num_key_value_heads and head_dim default to None (heads, hidden/heads); attention_dropout may be null
FAMILY = Family("llama", read, MegatronMapping("LlamaForCausalLM", CONFIG, LLAMA_FIXED, UNSUPPORTED,
                                               LLAMA_WEIGHTS + DENSE_MLP_WEIGHTS),
                derived=frozenset({"num_key_value_heads", "head_dim"}), nullable=frozenset({"attention_dropout"}))
