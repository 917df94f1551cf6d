"""Llama (model_type llama): HF config and weight names <-> Megatron-Core GPTModel, as data."""

from toolkit.mappings import (
    DENSE_MLP_WEIGHTS,
    LLAMA_LINEAGE_FIXED,
    LLAMA_LINEAGE_WEIGHTS,
    FamilyMapping,
    Field,
    Unsupported,
    llama_lineage_fields,
    rope_scaling_enabled,
    rope_scaling_factor,
)

CONFIG = llama_lineage_fields(eps_default=1e-6, theta_default=10000.0) + (
    # Llama 3.1's frequency scaling is Megatron-Core's `rope_scaling`; the converter writes the HF dict back itself
    Field("rope_scaling", "gpt_model.rope_scaling", None, rope_scaling_enabled, to_hf=False),
    Field("rope_scaling", "gpt_model.rope_scaling_factor", None, rope_scaling_factor, to_hf=False),
)

UNSUPPORTED = (
    Unsupported("attention_bias", bool, "Llama's attention_bias also biases o_proj, which Megatron-Core only biases "
                                        "together with the MLP (add_bias_linear); train without attention bias"),
    Unsupported("mlp_bias", bool, "MLP biases without attention-output biases have no Megatron-Core equivalent"),
)

WEIGHTS = LLAMA_LINEAGE_WEIGHTS + DENSE_MLP_WEIGHTS

MAPPINGS = (FamilyMapping("llama", "LlamaForCausalLM", CONFIG, LLAMA_LINEAGE_FIXED, UNSUPPORTED, WEIGHTS),)
