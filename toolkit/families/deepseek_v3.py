"""DeepSeek-V3 / R1 and Kimi K2 (model_type deepseek_v3; Kimi K2's config.json says kimi_k2 and names
DeepseekV3ForCausalLM): its HF config read into a ModelSpec.

Read off transformers' DeepseekV3 modules (models/deepseek_v3/modeling_deepseek_v3.py, transformers 5.23):
- multi-latent attention: q_a_proj (hidden -> q_lora_rank), q_a_layernorm, q_b_proj (-> heads x (qk_nope + qk_rope));
  or q_proj directly when q_lora_rank is null; kv_a_proj_with_mqa (hidden -> kv_lora_rank + qk_rope), kv_a_layernorm,
  kv_b_proj (kv_lora_rank -> heads x (qk_nope + v_head_dim)), o_proj (heads x v_head_dim -> hidden); attention_bias
  biases q_a_proj, kv_a_proj_with_mqa and o_proj;
- layers before first_k_dense_replace are dense (intermediate_size), the rest MoE: n_routed_experts experts of
  moe_intermediate_size, top num_experts_per_tok, plus one shared MLP of n_shared_experts x moe_intermediate_size;
- the router scores with a sigmoid, chooses within the topk_group best of n_group groups, and adds
  e_score_correction_bias (a buffer, not a parameter) to the scores it chooses by;
- num_nextn_predict_layers multi-token prediction modules are in the checkpoint (model.layers.61 of DeepSeek-V3) but
  transformers builds none (it ignores those weights on load); Megatron-Core trains them (--mtp-num-layers).
transformers has no moe_layer_freq (DeepSeek's own modeling code has): a value other than 1 is refused.
"""

from toolkit.errors import UserInputError
from toolkit.families.family import Family, HFConfig
from toolkit.families.lineage import llama_spec


def read(cfg: HFConfig) -> dict:
    layers, experts = cfg.integer("num_hidden_layers"), cfg.integer("n_routed_experts")
    if "moe_layer_freq" in cfg and cfg.data["moe_layer_freq"] != 1:
        raise UserInputError(f"{cfg.source}: moe_layer_freq", "transformers' DeepseekV3 makes every layer from "
                                                              "first_k_dense_replace on an MoE layer; only 1 is read")
    dense = cfg.integer("first_k_dense_replace")
    moe_layers = tuple(range(dense, layers)) if experts else ()
    nope, rope = cfg.integer("qk_nope_head_dim"), cfg.integer("qk_rope_head_dim")
    bias = cfg.flag("attention_bias")
    groups, group_topk = cfg.integer("n_group"), cfg.integer("topk_group")
    moe = dict(num_experts=experts, experts_top_k=cfg.integer("num_experts_per_tok"),
               moe_ffn_hidden_size=cfg.integer("moe_intermediate_size"), moe_layers=moe_layers,
               shared_expert_ffn_hidden_size=cfg.integer("n_shared_experts") * cfg.integer("moe_intermediate_size"),
               moe_router_score="sigmoid", moe_router_expert_bias=True,
               moe_router_groups=groups, moe_router_group_topk=group_topk) if moe_layers else {}
    return llama_spec(
        cfg, head_dim=nope + rope, num_kv_heads=cfg.integer("num_attention_heads"), qkv_bias=bias, attn_out_bias=bias, q_lora_rank=cfg.integer("q_lora_rank"),
        kv_lora_rank=cfg.integer("kv_lora_rank"), qk_rope_head_dim=rope, v_head_dim=cfg.integer("v_head_dim"),
        mtp_layers=cfg.integer("num_nextn_predict_layers") or 0, **moe)


# DeepseekV3Config: q_lora_rank may be null (queries projected directly), num_key_value_heads is not read (MLA's
# keys and values are per head; the attention never shapes a weight by it), attention_dropout may be null; it has no head_dim field of its own in config.json
# (it derives qk_rope_head_dim) and defaults num_nextn_predict_layers to None where config.json has none
FAMILY = Family("deepseek_v3", read, derived=frozenset({"num_key_value_heads", "head_dim", "num_nextn_predict_layers"}),
                nullable=frozenset({"q_lora_rank", "attention_dropout"}),
                unmapped="the toolkit's megatron.yaml and weight tables do not yet map it onto Megatron-Core 0.16.1's "
                         "MLATransformerConfig (multi_latent_attention, which the Megatron backend builds, also with "
                         "the local spec on CPU ranks), the linear_q/kv down/up weights, shared experts, the router's "
                         "expert bias, first_k_dense_replace (moe_layer_freq) or the MTP block; estimate it, or train "
                         "it with fsdp")
