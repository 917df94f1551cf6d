"""Mixtral (model_type mixtral): HF config and weight names <-> Megatron-Core GPTModel with MoE layers, as data.

HF's router takes a softmax over all experts, keeps the top k and renormalises them: Megatron-Core's default
(`moe_router_pre_softmax` false: top k of the logits, softmax over those) computes the same weights.
"""

from toolkit.mappings import LLAMA_LINEAGE_FIXED, LLAMA_LINEAGE_WEIGHTS, FamilyMapping, Field, GatedMLP, Rename, \
    llama_lineage_fields
from toolkit.mappings.mistral import sliding_window, window_size

CONFIG = llama_lineage_fields(eps_default=1e-5, theta_default=1e6) + (
    Field("sliding_window", "transformer_config.window_size", None, window_size, sliding_window),
    Field("num_local_experts", "transformer_config.num_moe_experts", 8),
    Field("num_experts_per_tok", "transformer_config.moe_router_topk", 2),
    Field("intermediate_size", "transformer_config.moe_ffn_hidden_size"),
    Field("router_aux_loss_coef", "transformer_config.moe_aux_loss_coeff", 0.001, float),
)

FIXED = {**LLAMA_LINEAGE_FIXED, "transformer_config.moe_router_load_balancing_type": "aux_loss"}

MOE = "model.layers.{layer}.block_sparse_moe"
EXPERT = "decoder.layers.{layer}.mlp.experts.local_experts.{expert}"
WEIGHTS = LLAMA_LINEAGE_WEIGHTS + (
    Rename(f"{MOE}.gate.weight", "decoder.layers.{layer}.mlp.router.weight"),
    GatedMLP(f"{MOE}.experts.{{expert}}.w1.weight", f"{MOE}.experts.{{expert}}.w3.weight", f"{EXPERT}.linear_fc1.weight"),
    Rename(f"{MOE}.experts.{{expert}}.w2.weight", f"{EXPERT}.linear_fc2.weight"),
)

MAPPINGS = (FamilyMapping("mixtral", "MixtralForCausalLM", CONFIG, FIXED, (), WEIGHTS),)
