"""Qwen2 / Qwen2.5 (model_type qwen2): its HF config read into a ModelSpec, and its Megatron-Core GPTModel mapping.

Qwen2 biases q, k and v (not o_proj, not the MLP): Megatron-Core's `add_qkv_bias` with `add_bias_linear` false.
"""

from toolkit.families.family import Family, HFConfig
from toolkit.families.lineage import DENSE_MLP_WEIGHTS, LLAMA_FIXED, LLAMA_WEIGHTS, llama_megatron_fields, llama_spec
from toolkit.families.mapping import QKV, MegatronMapping, Unsupported


def read(cfg: HFConfig) -> dict:
    return llama_spec(cfg, qkv_bias=True)


UNSUPPORTED = (
    Unsupported("use_sliding_window", bool, "Qwen2's per-layer sliding window (max_window_layers) has no "
                                            "Megatron-Core equivalent here"),
)

ATTN = "model.layers.{layer}.self_attn"
WEIGHTS = LLAMA_WEIGHTS + DENSE_MLP_WEIGHTS + (
    QKV(f"{ATTN}.q_proj.bias", f"{ATTN}.k_proj.bias", f"{ATTN}.v_proj.bias",
        "decoder.layers.{layer}.self_attention.linear_qkv.bias"),
)

MAPPING = MegatronMapping("Qwen2ForCausalLM", llama_megatron_fields(eps_default=1e-6, theta_default=10000.0),
                          {**LLAMA_FIXED, "transformer_config.add_qkv_bias": True}, UNSUPPORTED, WEIGHTS)

# Qwen2Config has no head_dim field (Qwen2Attention takes hidden/heads); num_key_value_heads may be null
FAMILY = Family("qwen2", read, MAPPING, derived=frozenset({"head_dim"}), nullable=frozenset({"num_key_value_heads"}))
