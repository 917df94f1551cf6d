"""Mistral (model_type mistral): HF config and weight names <-> Megatron-Core GPTModel, as data."""

from toolkit.mappings import DENSE_MLP_WEIGHTS, LLAMA_LINEAGE_FIXED, LLAMA_LINEAGE_WEIGHTS, FamilyMapping, Field, \
    llama_lineage_fields


def window_size(sliding_window):
    """HF's sliding window (tokens looked back) -> Megatron's (left, right) attention window; None: full causal."""
    return None if sliding_window is None else [int(sliding_window), 0]


def sliding_window(window):
    return None if window is None else window[0]


CONFIG = llama_lineage_fields(eps_default=1e-6, theta_default=10000.0) + (
    Field("sliding_window", "transformer_config.window_size", 4096, window_size, sliding_window),
)

WEIGHTS = LLAMA_LINEAGE_WEIGHTS + DENSE_MLP_WEIGHTS

MAPPINGS = (FamilyMapping("mistral", "MistralForCausalLM", CONFIG, LLAMA_LINEAGE_FIXED, (), WEIGHTS),)
