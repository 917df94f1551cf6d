"""Mixtral (model_type mixtral): its HF config read into a ModelSpec, and its Megatron-Core GPTModel mapping (MoE).

HF's router takes a softmax over all experts, keeps the top k and renormalises them: Megatron-Core's default
(`moe_router_pre_softmax` false: top k of the logits, softmax over those) computes the same weights.
"""

from toolkit.families.family import Family, HFConfig
from toolkit.families.lineage import (
    LLAMA_FIXED,
    LLAMA_WEIGHTS,
    MOE_ROUTING,
    llama_megatron_fields,
    llama_spec,
    moe_weights,
)
from toolkit.families.mapping import Field, MegatronMapping
from toolkit.families.mistral import sliding_window, window_size


def read(cfg: HFConfig) -> dict:
    return llama_spec(cfg, num_experts=cfg.integer("num_local_experts"),
                      experts_top_k=cfg.integer("num_experts_per_tok"),
                      moe_ffn_hidden_size=cfg.integer("intermediate_size"))


CONFIG = llama_megatron_fields(eps_default=1e-5, theta_default=1e6) + (
    Field("sliding_window", "transformer_config.window_size", None, window_size, sliding_window),
    Field("num_local_experts", "transformer_config.num_moe_experts", 8),
    Field("num_experts_per_tok", "transformer_config.moe_router_topk", 2),
    Field("intermediate_size", "transformer_config.moe_ffn_hidden_size"),
    Field("router_aux_loss_coef", "transformer_config.moe_aux_loss_coeff", 0.001, float),
)

MOE = "model.layers.{layer}.block_sparse_moe"
WEIGHTS = LLAMA_WEIGHTS + moe_weights(f"{MOE}.gate.weight", f"{MOE}.experts.{{expert}}", "w1", "w3", "w2")

FAMILY = Family("mixtral", read, MegatronMapping("MixtralForCausalLM", CONFIG, {**LLAMA_FIXED, **MOE_ROUTING}, (),
                                                 WEIGHTS),
                derived=frozenset({"head_dim"}))  # MixtralConfig: None; MixtralAttention takes hidden/heads
