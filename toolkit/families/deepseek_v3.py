"""DeepSeek-V3 / R1 and Kimi K2 (model_type deepseek_v3; Kimi K2's config.json says kimi_k2 and names
DeepseekV3ForCausalLM): its HF config read into a ModelSpec, and its Megatron-Core GPTModel mapping (MLA, MoE).

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

Onto Megatron-Core 0.16.1's MLATransformerConfig and the local spec's MLASelfAttention, as Megatron-Bridge's
DeepSeek-V3 bridge names them: q_proj / q_a_proj, q_a_layernorm, q_b_proj are linear_q_proj / linear_q_down_proj,
q_layernorm, linear_q_up_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj are linear_kv_down_proj, kv_layernorm,
linear_kv_up_proj, in the same layouts (Megatron-Core splits [kv_lora_rank; rope] and per head [k_nope; v] as
transformers does), so every attention weight is a rename. The dense layers' MLP, the experts and the shared experts
fuse gate and up into linear_fc1; e_score_correction_bias is the router's expert_bias. Megatron-Core rotates the
rope half of queries and keys as interleaved pairs, transformers' rope_interleave (its default). Plain rope and YaRN
map (rope_type, rotary_scaling_factor, mscale, mscale_all_dim: the same cos/sin and softmax scales); the router is
Megatron-Core's sigmoid with expert bias, top-k renormalised, scaled by routed_scaling_factor and limited to
topk_group of n_group groups where topk / topk_group is 2 (transformers ranks groups by their top 2 scores,
Megatron-Core by their top topk / topk_group). What cannot be said that way is refused in one line (UNSUPPORTED,
group_topk, mla_rope). The MTP modules are not converted: the mapping builds none, as transformers does, so
hf-to-megatron does not read a checkpoint's model.layers.{num_hidden_layers}+ weights and megatron-to-hf writes none.
The local core attention writes heads x kv_channels: the builder sets kv_channels to v_head_dim for MLA.
"""

from toolkit.errors import UserInputError
from toolkit.families.activations import hf_activation, megatron_activation
from toolkit.families.family import Family, HFConfig
from toolkit.families.lineage import DENSE_MLP_WEIGHTS, llama_spec, moe_weights, rope_theta, rotary_base
from toolkit.families.mapping import Field, GatedMLP, MegatronMapping, Rename, Unsupported


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
        cfg, head_dim=nope + rope, num_kv_heads=cfg.integer("num_attention_heads"), qkv_bias=bias, attn_out_bias=bias,
        q_lora_rank=cfg.integer("q_lora_rank"),
        kv_lora_rank=cfg.integer("kv_lora_rank"), qk_rope_head_dim=rope, v_head_dim=cfg.integer("v_head_dim"),
        mtp_layers=cfg.integer("num_nextn_predict_layers") or 0, **moe)



# -- Megatron-Core ------------------------------------------------------------------------------------------------

YARN_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}  # transformers' and Megatron-Core's defaults (the YaRN paper's)
# DeepseekV3Config's defaults (transformers 5.23) of the keys more than one Megatron field reads
DEFAULTS = {"first_k_dense_replace": 3, "n_shared_experts": 1, "moe_intermediate_size": 2048,
            "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4}


# transformers' DeepseekV3RMSNorm default, which q_a_layernorm and kv_a_layernorm keep whatever rms_norm_eps says
# (DeepSeek's own modeling code too); Megatron-Core gives every norm layernorm_epsilon
LATENT_NORM_EPS = 1e-6


def _hf(hf: dict, key: str):
    return hf.get(key, DEFAULTS[key])


def _rope_key(hf: dict) -> str:
    """Where a config says its rope: transformers 5 writes rope_parameters, DeepSeek's config.json rope_scaling."""
    return "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"


def mla_rope(hf: dict) -> dict:
    """MLATransformerConfig's rope fields of an HF config: plain rope, or YaRN as transformers computes it (the
    cos/sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim) and the softmax by
    mscale(factor, mscale_all_dim)^2, as Megatron-Core's MLA does); other rope types are refused."""
    key = _rope_key(hf)
    params = hf.get(key) or {}
    kind = params.get("rope_type", params.get("type")) or "default"
    neutral = {"rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0, **YARN_BETAS,
               "original_max_position_embeddings": hf.get("max_position_embeddings")}
    if kind == "default":
        return {"rope_type": "rope", **neutral}
    if kind != "yarn":
        raise UserInputError(f"model.config.{key}", f"rope_type '{kind}' has no Megatron-Core MLA equivalent "
                                                    f"(default and yarn are mapped)")
    extra = [k for k in ("attention_factor", "partial_rotary_factor") if params.get(k) not in (None, 1, 1.0)]
    if params.get("truncate") is False:
        extra.append("truncate=false")
    if params.get("factor") is None or params.get("original_max_position_embeddings") is None:
        extra.append("no factor or original_max_position_embeddings")
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if all_dim and not mscale:  # transformers: cos/sin by mscale(factor), softmax by mscale(factor, all_dim)^2
        extra.append("mscale_all_dim without mscale")
    if extra:
        raise UserInputError(f"model.config.{key}", f"yarn with {', '.join(extra)} is not mapped onto Megatron-Core's "
                                                    f"YarnRotaryEmbedding")
    scales = {"mscale": float(mscale), "mscale_all_dim": float(all_dim)} if mscale and all_dim else \
        {"mscale": 1.0, "mscale_all_dim": 0.0}  # transformers: mscale(factor) on cos/sin, nothing on the softmax
    return {"rope_type": "yarn", "rotary_scaling_factor": float(params["factor"]),
            "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
            **{k: float(params.get(k) or v) for k, v in YARN_BETAS.items()}, **scales}


def moe_layer_freq(hf: dict) -> list[int]:
    """Megatron-Core's moe_layer_freq as a list: the first first_k_dense_replace layers dense (0), the rest MoE."""
    dense, layers = _hf(hf, "first_k_dense_replace") or 0, hf["num_hidden_layers"]
    return [0] * min(dense, layers) + [1] * max(layers - dense, 0)


def group_topk(hf: dict) -> int | None:
    """Group-limited routing: transformers ranks the n_group groups by the sum of each group's top 2 biased scores,
    Megatron-Core by the sum of its top (topk / group_topk); one group is plain top-k routing in both."""
    groups, chosen, topk = (_hf(hf, k) or 1 for k in ("n_group", "topk_group", "num_experts_per_tok"))
    if groups == 1:
        return None
    if topk // chosen != 2:
        raise UserInputError("model.config.topk_group", f"{chosen} of {groups} groups with top {topk}: Megatron-Core "
                                                        f"ranks groups by their top {topk // chosen} scores, "
                                                        f"transformers by their top 2; only topk / topk_group = 2 "
                                                        f"maps")
    return chosen


def shared_expert_size(hf: dict) -> int | None:
    return (_hf(hf, "n_shared_experts") or 0) * _hf(hf, "moe_intermediate_size") or None


# DeepseekV3Config's defaults (transformers 5.23) for keys a config.json may leave out
CONFIG = (
    Field("num_hidden_layers", "transformer_config.num_layers"),
    Field("hidden_size", "transformer_config.hidden_size"),
    Field("num_attention_heads", "transformer_config.num_attention_heads"),
    Field("num_attention_heads", "transformer_config.num_query_groups", to_hf=False),  # MLA: keys/values per head
    Field("intermediate_size", "transformer_config.ffn_hidden_size"),
    Field("rms_norm_eps", "transformer_config.layernorm_epsilon", LATENT_NORM_EPS, float),
    Field("initializer_range", "transformer_config.init_method_std", 0.02, float),
    Field("attention_dropout", "transformer_config.attention_dropout", 0.0, lambda v: float(v or 0.0)),
    Field("hidden_act", "transformer_config.activation_func", "silu", megatron_activation, hf_activation),
    Field("q_lora_rank", "transformer_config.q_lora_rank", 1536),
    Field("kv_lora_rank", "transformer_config.kv_lora_rank", 512),
    Field("qk_nope_head_dim", "transformer_config.qk_head_dim", 128),
    Field("qk_rope_head_dim", "transformer_config.qk_pos_emb_head_dim", 64),
    Field("v_head_dim", "transformer_config.v_head_dim", 128),
    Field("rope_theta", "transformer_config.rotary_base", lambda hf: rope_theta(hf, 10000.0), rotary_base),
    *(Field("rope_parameters", f"transformer_config.{name}", None, lambda hf, name=name: mla_rope(hf)[name], False,
            whole=True)
      for name in ("rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
                   "beta_slow", "mscale", "mscale_all_dim")),
    Field("n_routed_experts", "transformer_config.num_moe_experts", 256),
    Field("num_experts_per_tok", "transformer_config.moe_router_topk", DEFAULTS["num_experts_per_tok"]),
    Field("moe_intermediate_size", "transformer_config.moe_ffn_hidden_size", DEFAULTS["moe_intermediate_size"]),
    Field("n_shared_experts", "transformer_config.moe_shared_expert_intermediate_size", DEFAULTS["n_shared_experts"],
          shared_expert_size, False, whole=True),
    Field("routed_scaling_factor", "transformer_config.moe_router_topk_scaling_factor", 2.5, float),
    Field("n_group", "transformer_config.moe_router_num_groups", DEFAULTS["n_group"],
          lambda v: v if (v or 1) > 1 else None, lambda v: v or 1),
    Field("topk_group", "transformer_config.moe_router_group_topk", DEFAULTS["topk_group"], group_topk,
          lambda v: v or 1, whole=True),
    Field("first_k_dense_replace", "transformer_config.moe_layer_freq", DEFAULTS["first_k_dense_replace"],
          moe_layer_freq, False, whole=True),
    # DeepSeek's own configuration_deepseek.py: aux_loss_alpha 0.001, its sequence-wise balance loss (seq_aux)
    Field("aux_loss_alpha", "transformer_config.moe_aux_loss_coeff", 0.001, float),
    Field("vocab_size", "model.vocab_size"),
    Field("max_position_embeddings", "gpt_model.max_sequence_length"),
    Field("tie_word_embeddings", "gpt_model.share_embeddings_and_output_weights", False, bool),
)

FIXED = {
    "transformer_config.multi_latent_attention": True,
    "transformer_config.normalization": "RMSNorm",
    "transformer_config.gated_linear_unit": True,
    "transformer_config.add_bias_linear": False,
    "transformer_config.add_qkv_bias": False,
    "transformer_config.qk_layernorm": True,  # q_a_layernorm / kv_a_layernorm: the local spec's q/kv_layernorm
    "transformer_config.hidden_dropout": 0.0,
    "transformer_config.moe_router_score_function": "sigmoid",
    "transformer_config.moe_router_enable_expert_bias": True,  # e_score_correction_bias
    "transformer_config.moe_router_dtype": "fp32",  # transformers' router scores in fp32
    "transformer_config.moe_router_load_balancing_type": "seq_aux_loss",
    "gpt_model.position_embedding_type": "rope",
}

UNSUPPORTED = (
    Unsupported("rms_norm_eps", lambda v: float(v) != LATENT_NORM_EPS, f"transformers' q_a/kv_a norms use "
                                                                       f"{LATENT_NORM_EPS} whatever it says, "
                                                                       f"Megatron-Core one epsilon for every norm"),
    Unsupported("attention_bias", bool, "Megatron-Core's MLA projections have no biases (q_a_proj, "
                                        "kv_a_proj_with_mqa and o_proj have)"),
    Unsupported("rope_interleave", lambda v: v is False, "Megatron-Core's MLA always rotates interleaved pairs"),
    Unsupported("norm_topk_prob", lambda v: not v, "un-normalised top-k routing weights are not mapped; "
                                                   "Megatron-Core's sigmoid router renormalises the top k"),
    Unsupported("num_experts_per_tok", lambda v: v == 1, "one expert per token: transformers normalises its weight "
                                                         "to 1, Megatron-Core's sigmoid router keeps the score"),
    Unsupported("moe_layer_freq", lambda v: v != 1, "transformers' DeepseekV3 makes every layer from "
                                                    "first_k_dense_replace on an MoE layer"),
)

LAYER = "model.layers.{layer}"
ATTN, MLA = f"{LAYER}.self_attn", "decoder.layers.{layer}.self_attention"
MLP, MCORE_MLP = f"{LAYER}.mlp", "decoder.layers.{layer}.mlp"
WEIGHTS = (
    Rename("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
    Rename(f"{LAYER}.input_layernorm.weight", "decoder.layers.{layer}.input_layernorm.weight"),
    Rename(f"{ATTN}.q_proj.weight", f"{MLA}.linear_q_proj.weight"),  # q_lora_rank null; the next three otherwise
    Rename(f"{ATTN}.q_a_proj.weight", f"{MLA}.linear_q_down_proj.weight"),
    Rename(f"{ATTN}.q_a_layernorm.weight", f"{MLA}.q_layernorm.weight"),
    Rename(f"{ATTN}.q_b_proj.weight", f"{MLA}.linear_q_up_proj.weight"),
    Rename(f"{ATTN}.kv_a_proj_with_mqa.weight", f"{MLA}.linear_kv_down_proj.weight"),  # [kv_lora_rank; rope] both
    Rename(f"{ATTN}.kv_a_layernorm.weight", f"{MLA}.kv_layernorm.weight"),
    Rename(f"{ATTN}.kv_b_proj.weight", f"{MLA}.linear_kv_up_proj.weight"),  # per head [k_nope; v] both
    Rename(f"{ATTN}.o_proj.weight", f"{MLA}.linear_proj.weight"),
    Rename(f"{LAYER}.post_attention_layernorm.weight", "decoder.layers.{layer}.pre_mlp_layernorm.weight"),
    *DENSE_MLP_WEIGHTS,  # the first first_k_dense_replace layers; the router and experts on the others
    *moe_weights(f"{MLP}.gate.weight", f"{MLP}.experts.{{expert}}", "gate_proj", "up_proj", "down_proj"),
    Rename(f"{MLP}.gate.e_score_correction_bias", f"{MCORE_MLP}.router.expert_bias"),
    GatedMLP(f"{MLP}.shared_experts.gate_proj.weight", f"{MLP}.shared_experts.up_proj.weight",
             f"{MCORE_MLP}.shared_experts.linear_fc1.weight"),
    Rename(f"{MLP}.shared_experts.down_proj.weight", f"{MCORE_MLP}.shared_experts.linear_fc2.weight"),
    Rename("model.norm.weight", "decoder.final_layernorm.weight"),
    Rename("lm_head.weight", "output_layer.weight"),  # absent when the embeddings are tied
)

# DeepseekV3Config: q_lora_rank may be null (queries projected directly), num_key_value_heads is not read (MLA's
# keys and values are per head; the attention never shapes a weight by it), attention_dropout may be null; it has no
# head_dim field of its own in config.json (it derives qk_rope_head_dim) and defaults num_nextn_predict_layers to None
# where config.json has none
FAMILY = Family("deepseek_v3", read, MegatronMapping("DeepseekV3ForCausalLM", CONFIG, FIXED, UNSUPPORTED, WEIGHTS),
                derived=frozenset({"num_key_value_heads", "head_dim", "num_nextn_predict_layers"}),
                nullable=frozenset({"q_lora_rank", "attention_dropout"}))
