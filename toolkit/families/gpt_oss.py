"""GPT-OSS (model_type gpt_oss): its HF config read into a ModelSpec, and its Megatron-Core GPTModel mapping.

Read off transformers' GptOss modules (models/gpt_oss/modeling_gpt_oss.py, transformers 5.23): every layer is an MoE
layer of num_local_experts experts of intermediate_size (gate_up_proj and down_proj with their biases), top
num_experts_per_tok, a router with a bias; attention is GQA with head_dim, q/k/v/o biased by attention_bias and one
learned sink logit per head; layer_types alternates sliding_attention (a window of sliding_window tokens, the token
itself included) and full_attention, sliding first, when config.json does not list them; embeddings are untied and
the vocabulary is o200k_harmony's 201,088 rows; rotary is YaRN (rope_scaling, rope_parameters in transformers 5),
whose attention factor the step model reads.

Onto Megatron-Core 0.16.1's local layer spec (no Transformer Engine needed): the sinks are DotProductAttention's
softmax_offset (softmax_type learnable, a sink column in FusedScaleMaskSoftmax's torch softmax); the sliding layers
are window_attn_skip_freq as a list with window_size (sliding_window - 1, 0); the experts are SequentialMLP's with
add_bias_linear (which also biases o_proj and the router, and takes expert tensor parallelism 1 only, refused
otherwise in spec/moe_rules.py); the clamped SwiGLU is quick_gelu (alpha 1.702) with glu_linear_offset 1 and
activation_func_clamp_value swiglu_limit; YaRN is GPTModel's position_embedding_type yarn with the yarn_* attributes
the builder sets on TransformerConfig. transformers stacks each layer's experts in one tensor, gate_up_proj [E, H, 2F]
with gate and up alternating on the last axis (x @ W): expert e's linear_fc1 is [gate; up] as [2F, H] (StackedExpert);
hf-to-megatron reads expert e's rows only, and megatron-to-hf gathers one layer's experts to write each stacked tensor. What cannot be said that way is refused
in one line (UNSUPPORTED, yarn). dmt generate refuses the family (generate/megatron.py, check_generatable).
"""

import math

from toolkit.errors import UserInputError
from toolkit.families.family import Family, HFConfig
from toolkit.families.lineage import LLAMA_WEIGHTS, MOE_EXPERT, llama_megatron_fields, llama_spec
from toolkit.families.mapping import QKV, Field, MegatronMapping, Rename, StackedExpert, Unsupported

LAYER_TYPES = ("sliding_attention", "full_attention")


def read(cfg: HFConfig) -> dict:
    layers, ffn = cfg.integer("num_hidden_layers"), cfg.integer("intermediate_size")
    types = cfg.data.get("layer_types") or [LAYER_TYPES[(i + 1) % 2 == 0] for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(LAYER_TYPES):
        raise UserInputError(f"{cfg.source}: layer_types", f"must list {layers} of {', '.join(LAYER_TYPES)}")
    window = cfg.integer("sliding_window")
    rope = cfg.data.get("rope_parameters") or cfg.data.get("rope_scaling") or {}  # transformers 5 / 4's key
    yarn = isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "yarn" and rope.get("factor", 1) > 1
    bias = cfg.flag("attention_bias")
    return llama_spec(
        cfg, qkv_bias=bias, attn_out_bias=bias, attention_sinks=True, num_experts=cfg.integer("num_local_experts"),
        experts_top_k=cfg.integer("num_experts_per_tok"), moe_ffn_hidden_size=ffn, expert_bias=True, router_bias=True,
        activation_clamp=cfg.number("swiglu_limit"),
        # YaRN's attention factor as transformers and Megatron-Core's YarnRotaryEmbedding derive it without mscale
        rope_attention_factor=(rope.get("attention_factor") or 0.1 * math.log(rope["factor"]) + 1) if yarn else 1.0,
        sliding_window=window, sliding_layers=tuple(i for i, t in enumerate(types) if t == LAYER_TYPES[0]) if window
        else None)



# -- Megatron-Core ------------------------------------------------------------------------------------------------

SWIGLU_ALPHA = 1.702  # Megatron-Core's quick_gelu: y * sigmoid(1.702 * y) (fusions/fused_bias_geglu.py), fixed
YARN_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}  # transformers' and Megatron-Core's defaults (the YaRN paper's)
# GptOssConfig's rope where config.json says none (transformers 5.23)
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, **YARN_BETAS, "truncate": False,
                "original_max_position_embeddings": 4096}


def _rope_key(hf: dict) -> str:
    """Where a config says its rope: transformers 5 writes rope_parameters, older config.json files rope_scaling."""
    return "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"


def window_size(hf: dict):
    """Megatron-Core's (left, right) window: its local mask keeps keys i - left .. i (transformer/utils.py,
    get_sliding_window_causal_mask), transformers' the sliding_window tokens up to and including i."""
    window = hf.get("sliding_window", 128)
    return None if window is None else [int(window) - 1, 0]


def layer_types(hf: dict) -> list[str]:
    layers = hf["num_hidden_layers"]
    return hf.get("layer_types") or [LAYER_TYPES[(i + 1) % 2 == 0] for i in range(layers)]


def window_layers(hf: dict) -> list[int]:
    """window_attn_skip_freq as a list: 1 for a sliding layer (utils.is_layer_window_attention), 0 for a full one."""
    return [int(kind == LAYER_TYPES[0]) for kind in layer_types(hf)]


def yarn(hf: dict) -> dict:
    """GPTModel's rope fields of an HF config: plain rope, or YaRN. Megatron-Core 0.16.1's GPTModel builds
    YarnRotaryEmbedding from yarn_* config attributes TransformerConfig does not declare (gpt_model.py), and its
    attention multiplies cos and sin by the attention factor they give (attention.py,
    _yarn_get_concentration_factor_from_config) as transformers does; an attention_factor given outright is refused."""
    key = _rope_key(hf)
    params = hf.get(key) or ({} if key in hf else GPT_OSS_ROPE)
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind == "default":
        return {"position_embedding_type": "rope"}
    if kind != "yarn":
        raise UserInputError(f"model.config.{key}", f"rope_type '{kind}' has no Megatron-Core GPTModel equivalent "
                                                    f"here (default and yarn are mapped)")
    extra = [k for k in ("attention_factor", "partial_rotary_factor") if params.get(k) is not None]
    if params.get("original_max_position_embeddings") is None:
        extra.append("no original_max_position_embeddings")
    if extra:
        raise UserInputError(f"model.config.{key}", f"yarn with {', '.join(extra)} is not mapped onto Megatron-Core's "
                                                    f"YarnRotaryEmbedding")
    original = int(params["original_max_position_embeddings"])
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    both = bool(mscale and all_dim)  # transformers: their ratio only when both are set, else mscale(factor)
    return {"position_embedding_type": "yarn",
            "yarn_rotary_scaling_factor": float(params.get("factor") or hf["max_position_embeddings"] / original),
            "yarn_original_max_position_embeddings": original,
            **{f"yarn_{k}": float(params.get(k) or v) for k, v in YARN_BETAS.items()},
            "yarn_mscale": float(mscale) if both else None, "yarn_mscale_all_dim": float(all_dim) if both else None,
            "yarn_correction_range_round_to_int": params.get("truncate", True) is not False}


def _yarn_field(section: str, name: str) -> Field:
    return Field("rope_parameters", f"{section}.{name}", None, lambda hf: yarn(hf).get(name), False, whole=True)


CONFIG = tuple(f for f in llama_megatron_fields(eps_default=1e-5, theta_default=150000.0)
               if f.hf != "hidden_act") + (  # the experts' activation is fixed (FIXED); hidden_act is not read
    Field("head_dim", "transformer_config.kv_channels", 64),
    Field("attention_bias", "transformer_config.add_qkv_bias", True, bool),
    Field("sliding_window", "transformer_config.window_size", None, window_size, False, whole=True),
    Field("layer_types", "transformer_config.window_attn_skip_freq", None, window_layers, False, whole=True),
    Field("swiglu_limit", "transformer_config.activation_func_clamp_value", 7.0, float),
    Field("num_local_experts", "transformer_config.num_moe_experts", 128),
    Field("num_experts_per_tok", "transformer_config.moe_router_topk", 4),
    Field("intermediate_size", "transformer_config.moe_ffn_hidden_size"),
    Field("router_aux_loss_coef", "transformer_config.moe_aux_loss_coeff", 0.001, float),
    _yarn_field("gpt_model", "position_embedding_type"),
    *(_yarn_field("transformer_config", f"yarn_{name}") for name in (
        "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
        "mscale_all_dim", "correction_range_round_to_int")),
)

FIXED = {
    "transformer_config.normalization": "RMSNorm",
    "transformer_config.gated_linear_unit": True,
    "transformer_config.activation_func": "quick_gelu",  # clamp(gate) * sigmoid(1.702 clamp(gate)) ...
    "transformer_config.glu_linear_offset": 1.0,  # ... * (clamp(up) + 1), transformers' GptOssExperts._apply_gate
    "transformer_config.add_bias_linear": True,  # o_proj, the router and the experts; biased experts need ETP 1
    "transformer_config.softmax_type": "learnable",  # the sinks: DotProductAttention's softmax_offset
    "transformer_config.qk_layernorm": False,
    "transformer_config.hidden_dropout": 0.0,
    "transformer_config.moe_router_load_balancing_type": "aux_loss",
}

UNSUPPORTED = (
    Unsupported("attention_bias", lambda v: not v, "Megatron-Core's add_bias_linear biases o_proj with the router "
                                                   "and experts; GPT-OSS without attention biases is not mapped"),
    Unsupported("swiglu_alpha", lambda v: float(v) != SWIGLU_ALPHA, f"Megatron-Core's quick_gelu fixes alpha at "
                                                                    f"{SWIGLU_ALPHA}"),
)

LAYER = "model.layers.{layer}"
ATTN, MCORE_ATTN = f"{LAYER}.self_attn", "decoder.layers.{layer}.self_attention"
MLP, MCORE_MLP = f"{LAYER}.mlp", "decoder.layers.{layer}.mlp"
WEIGHTS = LLAMA_WEIGHTS + (
    QKV(f"{ATTN}.q_proj.bias", f"{ATTN}.k_proj.bias", f"{ATTN}.v_proj.bias", f"{MCORE_ATTN}.linear_qkv.bias"),
    Rename(f"{ATTN}.o_proj.bias", f"{MCORE_ATTN}.linear_proj.bias"),
    Rename(f"{ATTN}.sinks", f"{MCORE_ATTN}.core_attention.softmax_offset"),
    Rename(f"{MLP}.router.weight", f"{MCORE_MLP}.router.weight"),
    Rename(f"{MLP}.router.bias", f"{MCORE_MLP}.router.bias"),
    StackedExpert(f"{MLP}.experts.gate_up_proj", f"{MOE_EXPERT}.linear_fc1.weight", interleaved=True),
    StackedExpert(f"{MLP}.experts.gate_up_proj_bias", f"{MOE_EXPERT}.linear_fc1.bias", interleaved=True),
    StackedExpert(f"{MLP}.experts.down_proj", f"{MOE_EXPERT}.linear_fc2.weight"),
    StackedExpert(f"{MLP}.experts.down_proj_bias", f"{MOE_EXPERT}.linear_fc2.bias"),
)

# GptOssConfig: layer_types and sliding_window default to None/derived; num_key_value_heads may be null
FAMILY = Family("gpt_oss", read, MegatronMapping("GptOssForCausalLM", CONFIG, FIXED, UNSUPPORTED, WEIGHTS),
                derived=frozenset({"layer_types"}), nullable=frozenset({"num_key_value_heads", "sliding_window"}))
