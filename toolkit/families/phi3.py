"""Phi-3 (model_type phi3): its HF config read into a ModelSpec (no Megatron-Core mapping here).

Phi-3 stores q/k/v as one qkv_proj and gate/up as one gate_up_proj, which holds the same parameters as the llama
lineage's separate projections.
"""

from toolkit.families.family import Family
from toolkit.families.lineage import llama_spec

# Phi3Config: num_key_value_heads defaults to None (the attention heads), no head_dim field (hidden/heads)
FAMILY = Family("phi3", llama_spec, derived=frozenset({"num_key_value_heads", "head_dim"}))
