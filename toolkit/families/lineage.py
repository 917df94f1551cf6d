"""What families of one lineage share key for key: the llama lineage (RMSNorm, gated MLP, rope: its ModelSpec reader,
Megatron-Core fields, fixed choices and weights) and the classic LayerNorm models (gpt2, gpt_neox, opt)."""

from __future__ import annotations

from toolkit.errors import UserInputError
from toolkit.families.activations import hf_activation, megatron_activation, spec_activation
from toolkit.families.family import HFConfig
from toolkit.families.mapping import QKV, Field, GatedMLP, Rename


def llama_spec(cfg: HFConfig, *, activation_key: str = "hidden_act", **overrides) -> dict:
    """ModelSpec fields of the llama lineage (llama, mistral, mixtral, qwen2/3, gemma2, phi3), with the family's
    own on top. A null or derived num_key_value_heads is the attention heads, a head_dim hidden/heads."""
    hidden, heads = cfg.integer("hidden_size"), cfg.integer("num_attention_heads")
    activation = cfg.text(activation_key)
    return dict(
        num_layers=cfg.integer("num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=cfg.integer("num_key_value_heads") or heads,
        head_dim=cfg.integer("head_dim") or hidden // heads,
        ffn_hidden_size=cfg.integer("intermediate_size"),
        vocab_size=cfg.integer("vocab_size"),
        max_position_embeddings=cfg.integer("max_position_embeddings"),
        tie_embeddings=cfg.flag("tie_word_embeddings"),
        activation=spec_activation(activation, gated=True, key=f"{cfg.source}: {activation_key}"),
        hf_activation=activation,
        attention_dropout=cfg.number("attention_dropout") or 0.0,
        norm="rmsnorm",
        position_embedding="rope",
    ) | overrides


def layernorm_spec(cfg: HFConfig, *, layers: str = "num_hidden_layers", hidden: str = "hidden_size",
                   heads: str = "num_attention_heads", positions: str = "max_position_embeddings",
                   activation: str = "hidden_act", **overrides) -> dict:
    """ModelSpec fields of the classic LayerNorm models (gpt2, gpt_neox, opt: full multi-head attention, an ungated
    MLP), read from the keys each family names them by, with the family's own on top."""
    hidden_size, num_heads, name = cfg.integer(hidden), cfg.integer(heads), cfg.text(activation)
    return dict(
        num_layers=cfg.integer(layers),
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden_size // num_heads,
        vocab_size=cfg.integer("vocab_size"),
        max_position_embeddings=cfg.integer(positions),
        tie_embeddings=cfg.flag("tie_word_embeddings"),
        activation=spec_activation(name, gated=False, key=f"{cfg.source}: {activation}"),
        hf_activation=name,
        norm="layernorm",
    ) | overrides


# -- Megatron-Core ------------------------------------------------------------------------------------------------

def rope_theta(hf_config: dict, default: float):
    """rope_theta, also where transformers 5 writes it (`rope_parameters`)."""
    params = hf_config.get("rope_parameters") or {}
    return float(params.get("rope_theta", hf_config.get("rope_theta", default)))


def rotary_base(theta: float) -> int | float:
    """Megatron-Core's GPTModel annotates rotary_base as an int and Megatron-LM parses --rotary-base as one; every
    published rope_theta is a whole number (10000, 500000, 1e6), which is how it is stored."""
    return int(theta) if float(theta).is_integer() else float(theta)


def rope_scaling_enabled(value) -> bool:
    """Megatron-Core's `rope_scaling` is Llama 3.1's frequency scaling; other HF rope types have no equivalent here."""
    if not value:
        return False
    kind = value.get("rope_type", value.get("type"))
    if kind in (None, "default"):
        return False
    if kind != "llama3":
        raise UserInputError("model.config.rope_scaling", f"rope_type '{kind}' has no Megatron-Core GPTModel "
                                                          f"equivalent here (llama3 scaling is supported)")
    fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    changed = [f"{k}={value[k]}" for k, v in fixed.items() if k in value and float(value[k]) != v]
    if changed:  # Megatron-Core's RotaryEmbedding only takes the factor; the rest are Llama 3.1's constants
        raise UserInputError("model.config.rope_scaling", f"{', '.join(changed)}: Megatron-Core applies llama3 "
                                                          f"scaling with {fixed} only")
    return True


def rope_scaling_factor(value) -> float:
    return float((value or {}).get("factor", 8.0)) if rope_scaling_enabled(value) else 8.0


def llama_megatron_fields(eps_default: float, theta_default: float, tie_default: bool = False) -> tuple[Field, ...]:
    """Megatron-Core config fields the mapped llama lineage (llama, mistral, mixtral, qwen2, qwen3) shares."""
    return (
        Field("num_hidden_layers", "transformer_config.num_layers"),
        Field("hidden_size", "transformer_config.hidden_size"),
        Field("num_attention_heads", "transformer_config.num_attention_heads"),
        Field("num_key_value_heads", "transformer_config.num_query_groups", lambda hf: hf["num_attention_heads"]),
        Field("head_dim", "transformer_config.kv_channels",
              lambda hf: hf["hidden_size"] // hf["num_attention_heads"]),
        Field("intermediate_size", "transformer_config.ffn_hidden_size"),
        Field("rms_norm_eps", "transformer_config.layernorm_epsilon", eps_default, float),
        Field("initializer_range", "transformer_config.init_method_std", 0.02, float),
        Field("attention_dropout", "transformer_config.attention_dropout", 0.0, float),
        Field("hidden_act", "transformer_config.activation_func", "silu", megatron_activation, hf_activation),
        Field("vocab_size", "model.vocab_size"),
        Field("max_position_embeddings", "gpt_model.max_sequence_length"),
        Field("rope_theta", "gpt_model.rotary_base", lambda hf: rope_theta(hf, theta_default), rotary_base),
        Field("tie_word_embeddings", "gpt_model.share_embeddings_and_output_weights", tie_default, bool),
    )


LLAMA_FIXED = {
    "transformer_config.normalization": "RMSNorm",
    "transformer_config.gated_linear_unit": True,
    "transformer_config.add_bias_linear": False,
    "transformer_config.add_qkv_bias": False,
    "transformer_config.qk_layernorm": False,
    "transformer_config.hidden_dropout": 0.0,
    "gpt_model.position_embedding_type": "rope",
}

LLAMA_WEIGHTS = (
    Rename("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
    Rename("model.layers.{layer}.input_layernorm.weight", "decoder.layers.{layer}.input_layernorm.weight"),
    QKV("model.layers.{layer}.self_attn.q_proj.weight", "model.layers.{layer}.self_attn.k_proj.weight",
        "model.layers.{layer}.self_attn.v_proj.weight", "decoder.layers.{layer}.self_attention.linear_qkv.weight"),
    Rename("model.layers.{layer}.self_attn.o_proj.weight", "decoder.layers.{layer}.self_attention.linear_proj.weight"),
    Rename("model.layers.{layer}.post_attention_layernorm.weight", "decoder.layers.{layer}.pre_mlp_layernorm.weight"),
    Rename("model.norm.weight", "decoder.final_layernorm.weight"),
    Rename("lm_head.weight", "output_layer.weight"),  # absent when the embeddings are tied
)

DENSE_MLP_WEIGHTS = (
    GatedMLP("model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.up_proj.weight",
             "decoder.layers.{layer}.mlp.linear_fc1.weight"),
    Rename("model.layers.{layer}.mlp.down_proj.weight", "decoder.layers.{layer}.mlp.linear_fc2.weight"),
)

MOE_ROUTING = {"transformer_config.moe_router_load_balancing_type": "aux_loss"}
MOE_EXPERT = "decoder.layers.{layer}.mlp.experts.local_experts.{expert}"


def moe_weights(hf_router: str, hf_expert: str, gate: str, up: str, down: str) -> tuple:
    """The router and experts of a llama-lineage MoE layer: `hf_expert` is the HF prefix of expert {expert}, and
    gate/up/down name its three projections there."""
    return (
        Rename(hf_router, "decoder.layers.{layer}.mlp.router.weight"),
        GatedMLP(f"{hf_expert}.{gate}.weight", f"{hf_expert}.{up}.weight", f"{MOE_EXPERT}.linear_fc1.weight"),
        Rename(f"{hf_expert}.{down}.weight", f"{MOE_EXPERT}.linear_fc2.weight"),
    )
