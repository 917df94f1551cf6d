"""Gemma 2 (model_type gemma2): its HF config read into a ModelSpec (no Megatron-Core mapping here).

Gemma 2 norms both sides of attention and of the MLP (four norms a layer); Gemma2Config defaults head_dim to 256 and
names its activation hidden_activation, which is what Gemma2MLP applies; attention_dropout may be null.
"""

from toolkit.families.family import Family, HFConfig
from toolkit.families.lineage import llama_spec


def read(cfg: HFConfig) -> dict:
    cfg.heads_divide_hidden(cfg.integer("hidden_size"), cfg.integer("num_attention_heads"))
    bias = cfg.flag("attention_bias")
    return llama_spec(cfg, activation_key="hidden_activation", qkv_bias=bias, attn_out_bias=bias, norms_per_layer=4)


FAMILY = Family("gemma2", read, nullable=frozenset({"attention_dropout"}))
