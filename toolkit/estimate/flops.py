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
    mlp_matmul: float = 0.0  # the dense MLP's share of `matmul` (0 in MoE layers)
    expert_matmul: float = 0.0  # MoE layers: the routed experts' top-k MLPs and the router

    @property
    def total(self) -> float:
        return self.matmul + self.attention


def layer_forward_flops(spec: ModelSpec, index: int, seq_len: float) -> LayerFlops:
    """2 FLOPs per multiply-add: linear layers 2 x weights; QK^T and PV 2 x 2 x s x (heads x head_dim), s the tokens
    each token attends to: the sequence, or over packed documents estimate/packed_attention.py's attended_tokens."""
    return _block_flops(spec, spec.is_moe_layer(index), seq_len)


@lru_cache(maxsize=4096)
def _block_flops(spec: ModelSpec, moe: bool, seq_len: float) -> LayerFlops:
    h, hd = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * hd, spec.num_kv_heads * hd
    attn_linear = h * (q + 2 * kv) + q * h
    mats = 3 if spec.gated_mlp else 2
    if moe:
        mlp = spec.experts_top_k * mats * h * spec.moe_ffn_hidden_size + h * spec.num_experts  # + router
    else:
        mlp = mats * h * spec.ffn_hidden_size
    return LayerFlops(matmul=2.0 * (attn_linear + mlp), attention=4.0 * seq_len * q, mlp_matmul=0.0 if moe else 2.0 * mlp,
                      expert_matmul=2.0 * mlp if moe else 0.0)


def head_forward_flops(spec: ModelSpec) -> float:
    return 2.0 * (spec.embed_proj_dim or spec.hidden_size) * spec.vocab_size


@lru_cache(maxsize=256)
def model_flops_per_token(spec: ModelSpec, seq_len: float) -> float:
    """Forward + backward FLOPs of one token with no recomputation (the MFU numerator)."""
    forward = sum(layer_forward_flops(spec, i, seq_len).total for i in range(spec.num_layers))
    return 3.0 * (forward + head_forward_flops(spec))


def recomputed_forward(layer: LayerFlops, recompute: str, modules: tuple[str, ...], checkpointed: bool) -> LayerFlops:
    """The part of a block's forward that activation recomputation runs again in backward (hardware, not model,
    FLOPs): the whole block when full recompute checkpoints it, else Megatron-Core's selective modules (core
    attention: the s^2 term; mlp: the dense MLP's matmuls)."""
    if recompute == "full":
        return layer if checkpointed else LayerFlops(0.0, 0.0)
    if recompute == "selective":
        mlp = layer.mlp_matmul if "mlp" in modules else 0.0
        return LayerFlops(matmul=mlp, attention=layer.attention if "core_attn" in modules else 0.0, mlp_matmul=mlp)
    return LayerFlops(0.0, 0.0)


def six_n_flops_per_token(spec: ModelSpec) -> float:
    """The 6N rule of thumb (Kaplan et al., arXiv:2001.08361) over active non-embedding parameters, for comparison."""
    counts = count_params(spec)
    return 6.0 * (counts.active - counts.embedding)
