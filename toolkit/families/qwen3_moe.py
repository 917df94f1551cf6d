"""Qwen3-MoE (model_type qwen3_moe): its HF config read into a ModelSpec, and its Megatron-Core GPTModel mapping.

It routes like Mixtral when `norm_topk_prob` is true (see mixtral.py). In transformers, layer i is an MoE layer when
it is not in mlp_only_layers and (i + 1) is a multiple of decoder_sparse_step; the others are dense.
"""

from toolkit.errors import UserInputError
from toolkit.families import qwen3
from toolkit.families.family import Family, HFConfig
from toolkit.families.lineage import LLAMA_WEIGHTS, MOE_ROUTING, moe_weights
from toolkit.families.mapping import Field, MegatronMapping, Unsupported


def read(cfg: HFConfig) -> dict:
    # config.json says num_experts; Qwen3MoeConfig.to_dict() says num_local_experts (its attribute_map)
    experts = cfg.integer("num_experts" if "num_experts" in cfg else "num_local_experts")
    step, skip = cfg.integer("decoder_sparse_step"), set(cfg.integers("mlp_only_layers"))
    moe_layers = tuple(i for i in range(cfg.integer("num_hidden_layers"))
                       if i not in skip and experts > 0 and (i + 1) % step == 0)
    if not moe_layers:
        return qwen3.read(cfg)
    return qwen3.read(cfg, num_experts=experts, experts_top_k=cfg.integer("num_experts_per_tok"),
                      moe_ffn_hidden_size=cfg.integer("moe_intermediate_size"), moe_layers=moe_layers)


def _num_local_experts(cfg: dict) -> int:
    """A config.json written by transformers' save_pretrained says num_local_experts (the attribute_map's name)."""
    if "num_local_experts" not in cfg:
        raise UserInputError("model.config.num_experts", "is required for a qwen3_moe model")
    return cfg["num_local_experts"]


CONFIG = qwen3.CONFIG + (
    Field("num_experts", "transformer_config.num_moe_experts", _num_local_experts),
    Field("num_experts_per_tok", "transformer_config.moe_router_topk"),
    Field("moe_intermediate_size", "transformer_config.moe_ffn_hidden_size"),
    Field("router_aux_loss_coef", "transformer_config.moe_aux_loss_coeff", 0.001, float),
)

UNSUPPORTED = qwen3.UNSUPPORTED + (
    Unsupported("norm_topk_prob", lambda v: not v, "un-normalised top-k routing weights are not mapped; Megatron-Core "
                                                   "renormalises the top k"),
    Unsupported("mlp_only_layers", bool, "dense layers between MoE layers are not mapped (moe_layer_freq)"),
    Unsupported("decoder_sparse_step", lambda v: v != 1, "MoE on every n-th layer only is not mapped"),
)

MLP = "model.layers.{layer}.mlp"
WEIGHTS = LLAMA_WEIGHTS + qwen3.ATTN_NORMS + moe_weights(f"{MLP}.gate.weight", f"{MLP}.experts.{{expert}}",
                                                         "gate_proj", "up_proj", "down_proj")

# Qwen3MoeConfig has no head_dim field (Qwen3MoeAttention takes hidden/heads) and defaults mlp_only_layers to None
FAMILY = Family("qwen3_moe", read, MegatronMapping("Qwen3MoeForCausalLM", CONFIG, {**qwen3.FIXED, **MOE_ROUTING},
                                                   UNSUPPORTED, WEIGHTS),
                derived=frozenset({"head_dim", "mlp_only_layers"}))
