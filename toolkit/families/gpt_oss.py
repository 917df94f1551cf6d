"""GPT-OSS (model_type gpt_oss): its HF config read into a ModelSpec.

Read off transformers' GptOss modules (models/gpt_oss/modeling_gpt_oss.py, transformers 5.23): every layer is an MoE
layer of num_local_experts experts of intermediate_size (gate_up_proj and down_proj with their biases), top
num_experts_per_tok, a router with a bias; attention is GQA with head_dim, q/k/v/o biased by attention_bias and one
learned sink logit per head; layer_types alternates sliding_attention (a window of sliding_window tokens, the token
itself included) and full_attention, sliding first, when config.json does not list them; embeddings are untied and
the vocabulary is o200k_harmony's 201,088 rows; rotary is YaRN (rope_scaling, rope_parameters in transformers 5),
whose attention factor the step model reads.
"""

import math

from toolkit.errors import UserInputError
from toolkit.families.family import Family, HFConfig
from toolkit.families.lineage import llama_spec

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


# GptOssConfig: layer_types and sliding_window default to None/derived; num_key_value_heads may be null
FAMILY = Family("gpt_oss", read, derived=frozenset({"layer_types"}),
                nullable=frozenset({"num_key_value_heads", "sliding_window"}),
                unmapped="not yet mapped: Megatron-Core 0.16.1 expresses its sinks (softmax_type learnable), "
                         "alternating windows (window_attn_skip_freq), clamped SwiGLU (glu_linear_offset, "
                         "activation_func_clamp_value) and biased experts (add_bias_linear, ETP 1 only), but the "
                         "toolkit has no table for its fused, interleaved gate_up_proj experts; estimate it, or "
                         "train it with fsdp")
