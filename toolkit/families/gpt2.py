"""GPT-2 (model_type gpt2): its HF config read into a ModelSpec, and its Megatron-Core GPTModel mapping.

GPT-2 is Megatron's original shape: learned absolute positions, LayerNorm with bias, biases on every linear layer,
tanh-approximated GELU (`openai_gelu`), tied embeddings. HF stores its linear layers as Conv1D ([in, out]), hence the
transposes, and c_attn as one [q; k; v] tensor.
"""

from toolkit.families.activations import hf_activation, megatron_activation
from toolkit.families.family import Family, HFConfig
from toolkit.families.lineage import layernorm_spec
from toolkit.families.mapping import Field, FusedQKV, MegatronMapping, Rename, Unsupported


def read(cfg: HFConfig) -> dict:
    positions = cfg.integer("n_positions")
    return layernorm_spec(
        cfg, layers="n_layer", hidden="n_embd", heads="n_head", positions="n_positions",
        activation="activation_function",
        ffn_hidden_size=cfg.integer("n_inner") or 4 * cfg.integer("n_embd"),
        hidden_dropout=max(cfg.number("resid_pdrop"), cfg.number("embd_pdrop")),
        attention_dropout=cfg.number("attn_pdrop"),
        position_embedding="learned", position_embedding_rows=positions,
        qkv_bias=True, attn_out_bias=True, mlp_bias=True,
    )


CONFIG = (
    Field("n_layer", "transformer_config.num_layers"),
    Field("n_embd", "transformer_config.hidden_size"),
    Field("n_head", "transformer_config.num_attention_heads"),
    Field("n_head", "transformer_config.num_query_groups", to_hf=False),
    Field("n_inner", "transformer_config.ffn_hidden_size", lambda hf: 4 * hf["n_embd"]),
    Field("layer_norm_epsilon", "transformer_config.layernorm_epsilon", 1e-5, float),
    Field("initializer_range", "transformer_config.init_method_std", 0.02, float),
    Field("resid_pdrop", "transformer_config.hidden_dropout", 0.1, float),
    Field("attn_pdrop", "transformer_config.attention_dropout", 0.1, float),
    Field("activation_function", "transformer_config.activation_func", "gelu_new", megatron_activation,
          hf_activation),
    Field("vocab_size", "model.vocab_size"),
    Field("n_positions", "gpt_model.max_sequence_length", 1024),
    Field("tie_word_embeddings", "gpt_model.share_embeddings_and_output_weights", True, bool),
)

FIXED = {
    "transformer_config.normalization": "LayerNorm",
    "transformer_config.gated_linear_unit": False,
    "transformer_config.add_bias_linear": True,
    "transformer_config.add_qkv_bias": True,
    "transformer_config.qk_layernorm": False,
    "gpt_model.position_embedding_type": "learned_absolute",
}

UNSUPPORTED = (
    Unsupported("scale_attn_by_inverse_layer_idx", bool, "per-layer attention scaling has no Megatron-Core "
                                                         "equivalent"),
    Unsupported("reorder_and_upcast_attn", bool, "is an HF-only attention variant"),
)


def weight_and_bias(hf: str, megatron: str, conv1d: bool = False) -> tuple[Rename, Rename]:
    """A module's weight and bias; a Conv1D weight is stored transposed, its bias is not."""
    return Rename(f"{hf}.weight", f"{megatron}.weight", conv1d), Rename(f"{hf}.bias", f"{megatron}.bias")


LAYER, BLOCK = "decoder.layers.{layer}", "transformer.h.{layer}"
WEIGHTS = (
    Rename("transformer.wte.weight", "embedding.word_embeddings.weight"),
    Rename("transformer.wpe.weight", "embedding.position_embeddings.weight"),
    *weight_and_bias(f"{BLOCK}.ln_1", f"{LAYER}.input_layernorm"),
    FusedQKV(f"{BLOCK}.attn.c_attn.weight", f"{LAYER}.self_attention.linear_qkv.weight", transpose=True),
    FusedQKV(f"{BLOCK}.attn.c_attn.bias", f"{LAYER}.self_attention.linear_qkv.bias"),
    *weight_and_bias(f"{BLOCK}.attn.c_proj", f"{LAYER}.self_attention.linear_proj", conv1d=True),
    *weight_and_bias(f"{BLOCK}.ln_2", f"{LAYER}.pre_mlp_layernorm"),
    *weight_and_bias(f"{BLOCK}.mlp.c_fc", f"{LAYER}.mlp.linear_fc1", conv1d=True),
    *weight_and_bias(f"{BLOCK}.mlp.c_proj", f"{LAYER}.mlp.linear_fc2", conv1d=True),
    *weight_and_bias("transformer.ln_f", "decoder.final_layernorm"),
)

FAMILY = Family("gpt2", read, MegatronMapping("GPT2LMHeadModel", CONFIG, FIXED, UNSUPPORTED, WEIGHTS),
                derived=frozenset({"n_inner"}))
