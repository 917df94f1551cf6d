"""Mistral (model_type mistral): its HF config read into a ModelSpec, and its Megatron-Core GPTModel mapping."""

from toolkit.families.family import Family
from toolkit.families.lineage import DENSE_MLP_WEIGHTS, LLAMA_FIXED, LLAMA_WEIGHTS, llama_megatron_fields, llama_spec
from toolkit.families.mapping import Field, MegatronMapping


def window_size(sliding_window):
    """HF's sliding window (tokens looked back) -> Megatron's (left, right) attention window; None: full causal."""
    return None if sliding_window is None else [int(sliding_window), 0]


def sliding_window(window):
    return None if window is None else window[0]


CONFIG = llama_megatron_fields(eps_default=1e-6, theta_default=10000.0) + (
    Field("sliding_window", "transformer_config.window_size", 4096, window_size, sliding_window),
)

FAMILY = Family("mistral", llama_spec, MegatronMapping("MistralForCausalLM", CONFIG, LLAMA_FIXED, (),
                                                       LLAMA_WEIGHTS + DENSE_MLP_WEIGHTS),
                derived=frozenset({"head_dim"}))  # MistralConfig: None, then hidden/heads
