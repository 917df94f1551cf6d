"""Mistral (model_type mistral): its HF config read into a ModelSpec, and its Megatron-Core GPTModel mapping."""

from toolkit.families.family import Family
from toolkit.families.lineage import DENSE_MLP_WEIGHTS, LLAMA_FIXED, LLAMA_WEIGHTS, llama_megatron_fields, llama_spec
from toolkit.families.mapping import Field, MegatronMapping


def window_size(sliding_window):
    """HF's sliding window -> Megatron's (left, right) attention window; None: full causal. transformers' window of w
    tokens holds the token itself and the w - 1 before it (masking_utils.sliding_window_overlay); Megatron-Core's and
    Transformer Engine's (left, 0) hold the token and `left` before it (transformer/utils.py
    get_sliding_window_causal_mask): left = w - 1."""
    return None if sliding_window is None else [int(sliding_window) - 1, 0]


def sliding_window(window):
    return None if window is None else window[0] + 1


CONFIG = llama_megatron_fields(eps_default=1e-6, theta_default=10000.0) + (
    Field("sliding_window", "transformer_config.window_size", 4096, window_size, sliding_window),
)

FAMILY = Family("mistral", llama_spec, MegatronMapping("MistralForCausalLM", CONFIG, LLAMA_FIXED, (),
                                                       LLAMA_WEIGHTS + DENSE_MLP_WEIGHTS),
                derived=frozenset({"head_dim"}))  # MistralConfig: None, then hidden/heads
