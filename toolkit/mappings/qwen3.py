"""Qwen3 dense (qwen3) and MoE (qwen3_moe): HF config and weight names <-> Megatron-Core GPTModel, as data.

Qwen3 drops Qwen2's q/k/v biases and normalises each head's queries and keys (RMSNorm over head_dim): Megatron-Core's
`qk_layernorm`. Qwen3-MoE routes like Mixtral when `norm_topk_prob` is true (see mixtral.py).
"""

from toolkit.mappings import DENSE_MLP_WEIGHTS, LLAMA_LINEAGE_FIXED, LLAMA_LINEAGE_WEIGHTS, FamilyMapping, Field, \
    GatedMLP, Rename, Unsupported, llama_lineage_fields

CONFIG = llama_lineage_fields(eps_default=1e-6, theta_default=10000.0)

FIXED = {**LLAMA_LINEAGE_FIXED, "transformer_config.qk_layernorm": True}

UNSUPPORTED = (
    Unsupported("attention_bias", bool, "Qwen3 with attention_bias also biases o_proj, which Megatron-Core only "
                                        "biases together with the MLP"),
    Unsupported("use_sliding_window", bool, "per-layer sliding windows have no Megatron-Core equivalent here"),
)

ATTN_NORMS = (
    Rename("model.layers.{layer}.self_attn.q_norm.weight", "decoder.layers.{layer}.self_attention.q_layernorm.weight"),
    Rename("model.layers.{layer}.self_attn.k_norm.weight", "decoder.layers.{layer}.self_attention.k_layernorm.weight"),
)

MOE_CONFIG = CONFIG + (
    Field("num_experts", "transformer_config.num_moe_experts"),
    Field("num_experts_per_tok", "transformer_config.moe_router_topk"),
    Field("moe_intermediate_size", "transformer_config.moe_ffn_hidden_size"),
    Field("router_aux_loss_coef", "transformer_config.moe_aux_loss_coeff", 0.001, float),
)

MOE_UNSUPPORTED = UNSUPPORTED + (
    Unsupported("norm_topk_prob", lambda v: not v, "un-normalised top-k routing weights are not mapped; Megatron-Core "
                                                   "renormalises the top k"),
    Unsupported("mlp_only_layers", bool, "dense layers between MoE layers are not mapped (moe_layer_freq)"),
    Unsupported("decoder_sparse_step", lambda v: v != 1, "MoE on every n-th layer only is not mapped"),
)

MLP = "model.layers.{layer}.mlp"
EXPERT = "decoder.layers.{layer}.mlp.experts.local_experts.{expert}"
MOE_WEIGHTS = LLAMA_LINEAGE_WEIGHTS + ATTN_NORMS + (
    Rename(f"{MLP}.gate.weight", "decoder.layers.{layer}.mlp.router.weight"),
    GatedMLP(f"{MLP}.experts.{{expert}}.gate_proj.weight", f"{MLP}.experts.{{expert}}.up_proj.weight",
             f"{EXPERT}.linear_fc1.weight"),
    Rename(f"{MLP}.experts.{{expert}}.down_proj.weight", f"{EXPERT}.linear_fc2.weight"),
)

MAPPINGS = (
    FamilyMapping("qwen3", "Qwen3ForCausalLM", CONFIG, FIXED, UNSUPPORTED, LLAMA_LINEAGE_WEIGHTS + ATTN_NORMS
                  + DENSE_MLP_WEIGHTS),
    FamilyMapping("qwen3_moe", "Qwen3MoeForCausalLM", MOE_CONFIG,
                  {**FIXED, "transformer_config.moe_router_load_balancing_type": "aux_loss"}, MOE_UNSUPPORTED,
                  MOE_WEIGHTS),
)
