"""GPT-2 (model_type gpt2): HF config and weight names <-> Megatron-Core GPTModel, as data.

GPT-2 is Megatron's original shape: learned absolute positions, LayerNorm with bias, biases on every linear layer,
tanh-approximated GELU (`openai_gelu`), tied embeddings. HF stores its linear layers as Conv1D ([in, out]), hence the
transposes, and c_attn as one [q; k; v] tensor.
"""

from toolkit.mappings import HF_ACTIVATIONS, FamilyMapping, Field, FusedQKV, Rename, Unsupported, activation

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
    Field("activation_function", "transformer_config.activation_func", "gelu_new", activation, HF_ACTIVATIONS.get),
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

LAYER, BLOCK = "decoder.layers.{layer}", "transformer.h.{layer}"
WEIGHTS = (
    Rename("transformer.wte.weight", "embedding.word_embeddings.weight"),
    Rename("transformer.wpe.weight", "embedding.position_embeddings.weight"),
    Rename(f"{BLOCK}.ln_1.weight", f"{LAYER}.input_layernorm.weight"),
    Rename(f"{BLOCK}.ln_1.bias", f"{LAYER}.input_layernorm.bias"),
    FusedQKV(f"{BLOCK}.attn.c_attn.weight", f"{LAYER}.self_attention.linear_qkv.weight", transpose=True),
    FusedQKV(f"{BLOCK}.attn.c_attn.bias", f"{LAYER}.self_attention.linear_qkv.bias"),
    Rename(f"{BLOCK}.attn.c_proj.weight", f"{LAYER}.self_attention.linear_proj.weight", transpose=True),
    Rename(f"{BLOCK}.attn.c_proj.bias", f"{LAYER}.self_attention.linear_proj.bias"),
    Rename(f"{BLOCK}.ln_2.weight", f"{LAYER}.pre_mlp_layernorm.weight"),
    Rename(f"{BLOCK}.ln_2.bias", f"{LAYER}.pre_mlp_layernorm.bias"),
    Rename(f"{BLOCK}.mlp.c_fc.weight", f"{LAYER}.mlp.linear_fc1.weight", transpose=True),
    Rename(f"{BLOCK}.mlp.c_fc.bias", f"{LAYER}.mlp.linear_fc1.bias"),
    Rename(f"{BLOCK}.mlp.c_proj.weight", f"{LAYER}.mlp.linear_fc2.weight", transpose=True),
    Rename(f"{BLOCK}.mlp.c_proj.bias", f"{LAYER}.mlp.linear_fc2.bias"),
    Rename("transformer.ln_f.weight", "decoder.final_layernorm.weight"),
    Rename("transformer.ln_f.bias", "decoder.final_layernorm.bias"),
)

MAPPINGS = (FamilyMapping("gpt2", "GPT2LMHeadModel", CONFIG, FIXED, UNSUPPORTED, WEIGHTS),)
