"""Qwen2 / Qwen2.5 (model_type qwen2): HF config and weight names <-> Megatron-Core GPTModel, as data.

Qwen2 biases q, k and v (not o_proj, not the MLP): Megatron-Core's `add_qkv_bias` with `add_bias_linear` false.
"""

from toolkit.mappings import DENSE_MLP_WEIGHTS, LLAMA_LINEAGE_FIXED, LLAMA_LINEAGE_WEIGHTS, QKV, FamilyMapping, \
    Unsupported, llama_lineage_fields

CONFIG = llama_lineage_fields(eps_default=1e-6, theta_default=10000.0)

FIXED = {**LLAMA_LINEAGE_FIXED, "transformer_config.add_qkv_bias": True}

UNSUPPORTED = (
    Unsupported("use_sliding_window", bool, "Qwen2's per-layer sliding window (max_window_layers) has no "
                                            "Megatron-Core equivalent here"),
)

ATTN = "model.layers.{layer}.self_attn"
WEIGHTS = LLAMA_LINEAGE_WEIGHTS + DENSE_MLP_WEIGHTS + (
    QKV(f"{ATTN}.q_proj.bias", f"{ATTN}.k_proj.bias", f"{ATTN}.v_proj.bias",
        "decoder.layers.{layer}.self_attention.linear_qkv.bias"),
)

MAPPINGS = (FamilyMapping("qwen2", "Qwen2ForCausalLM", CONFIG, FIXED, UNSUPPORTED, WEIGHTS),)
