"""GPT-NeoX / Pythia (model_type gpt_neox): its HF config read into a ModelSpec (no Megatron-Core mapping here).

Attention and MLP may read the same input (use_parallel_residual); attention_bias biases the fused query_key_value
and the output projection, the MLP always has biases.
"""

from toolkit.families.family import Family, HFConfig
from toolkit.families.lineage import layernorm_spec


def read(cfg: HFConfig) -> dict:
    cfg.heads_divide_hidden(cfg.integer("hidden_size"), cfg.integer("num_attention_heads"))
    bias = cfg.flag("attention_bias")
    return layernorm_spec(
        cfg, ffn_hidden_size=cfg.integer("intermediate_size"), hidden_dropout=cfg.number("hidden_dropout"),
        attention_dropout=cfg.number("attention_dropout"), position_embedding="rope", qkv_bias=bias,
        attn_out_bias=bias, mlp_bias=True, parallel_residual=cfg.flag("use_parallel_residual"),
    )


FAMILY = Family("gpt_neox", read)
