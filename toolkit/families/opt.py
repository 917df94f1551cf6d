"""OPT (model_type opt): its HF config read into a ModelSpec (no Megatron-Core mapping here).

OPTLearnedPositionalEmbedding keeps two rows more than max_position_embeddings; a word_embed_proj_dim other than
hidden_size adds project_in/project_out; the final LayerNorm exists only for pre-norm models that do not remove it
(`_remove_final_layer_norm`, kept by transformers for checkpoints fine-tuned before v4.20.1).
"""

from toolkit.families.family import Family, HFConfig
from toolkit.families.lineage import layernorm_spec

POSITION_OFFSET = 2


def read(cfg: HFConfig) -> dict:
    hidden, bias = cfg.integer("hidden_size"), cfg.flag("enable_bias")
    projection = cfg.integer("word_embed_proj_dim")
    projection = hidden if projection is None else projection  # OPTConfig.__post_init__
    return layernorm_spec(
        cfg, activation="activation_function", ffn_hidden_size=cfg.integer("ffn_dim"),
        hidden_dropout=cfg.number("dropout"), attention_dropout=cfg.number("attention_dropout"),
        norm_affine=cfg.flag("layer_norm_elementwise_affine"),
        final_norm=cfg.flag("do_layer_norm_before") and not cfg.flag("_remove_final_layer_norm"),
        position_embedding="learned",
        position_embedding_rows=cfg.integer("max_position_embeddings") + POSITION_OFFSET,
        qkv_bias=bias, attn_out_bias=bias, mlp_bias=bias,
        embed_proj_dim=projection if projection != hidden else None,
    )


FAMILY = Family("opt", read, derived=frozenset({"word_embed_proj_dim"}))
