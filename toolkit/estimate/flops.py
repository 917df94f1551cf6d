"""Training FLOPs from the architecture: matmuls of every linear layer, the attention s^2 term, the LM head.

Model FLOPs follow the PaLM convention (Chowdhery et al., arXiv:2204.02311, Appendix B): 6 x active matmul
parameters per token plus 12 x layers x attention width x sequence length per token for QK^T and PV, i.e.
attention counted over the full (not causally halved) score matrix, as Megatron-LM and the Llama 3 paper also
report MFU. Recomputation adds forward FLOPs to the hardware FLOPs but never to the model FLOPs used for MFU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from toolkit.estimate.params import count_params
from toolkit.spec.model import ModelSpec


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs per token of one block: dense matmuls and attention scores (s-dependent)."""

    matmul: float
    attention: float

    @property
    def total(self) -> float:
        return self.matmul + self.attention


def layer_forward_flops(spec: ModelSpec, index: int, seq_len: int) -> LayerFlops:
    """2 FLOPs per multiply-add: linear layers 2 x weights; QK^T and PV 2 x 2 x s x (heads x head_dim)."""
    return _block_flops(spec, spec.is_moe_layer(index), seq_len)


@lru_cache(maxsize=4096)
def _block_flops(spec: ModelSpec, moe: bool, seq_len: int) -> LayerFlops:
    h, hd = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * hd, spec.num_kv_heads * hd
    attn_linear = h * (q + 2 * kv) + q * h
    mats = 3 if spec.gated_mlp else 2
    if moe:
        mlp = spec.experts_top_k * mats * h * spec.moe_ffn_hidden_size + h * spec.num_experts  # + router
    else:
        mlp = mats * h * spec.ffn_hidden_size
    return LayerFlops(matmul=2.0 * (attn_linear + mlp), attention=4.0 * seq_len * q)


def head_forward_flops(spec: ModelSpec) -> float:
    return 2.0 * (spec.embed_proj_dim or spec.hidden_size) * spec.vocab_size


@lru_cache(maxsize=256)
def model_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Forward + backward FLOPs of one token with no recomputation (the MFU numerator)."""
    forward = sum(layer_forward_flops(spec, i, seq_len).total for i in range(spec.num_layers))
    return 3.0 * (forward + head_forward_flops(spec))


def recompute_flops_per_token(spec: ModelSpec, seq_len: int, recompute: str) -> float:
    """Extra forward FLOPs per token that activation recomputation spends (hardware, not model, FLOPs)."""
    if recompute == "full":
        return sum(layer_forward_flops(spec, i, seq_len).total for i in range(spec.num_layers))
    if recompute == "selective":  # core attention only
        return sum(layer_forward_flops(spec, i, seq_len).attention for i in range(spec.num_layers))
    return 0.0


def six_n_flops_per_token(spec: ModelSpec) -> float:
    """The 6N rule of thumb (Kaplan et al., arXiv:2001.08361) over active non-embedding parameters, for comparison."""
    counts = count_params(spec)
    return 6.0 * (counts.active - counts.embedding)
