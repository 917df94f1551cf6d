"""Training FLOPs from the architecture: matmuls of every linear layer, the attention s^2 term, the LM head.

Model FLOPs follow the PaLM convention (Chowdhery et al., arXiv:2204.02311, Appendix B): 6 x active matmul
parameters per token plus 12 x layers x attention width x sequence length per token for QK^T and PV, i.e.
attention counted over the full (not causally halved) score matrix, as Megatron-LM and the Llama 3 paper also
report MFU. Recomputation adds forward FLOPs to the hardware FLOPs but never to the model FLOPs used for MFU.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.estimate.params import count_params
from toolkit.spec.model import ModelSpec, per_model


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs per token of one block: dense matmuls and attention scores (s-dependent), with the shares of
    `matmul` that Megatron-Core's selective recompute modules run again."""

    matmul: float
    attention: float
    mlp_matmul: float = 0.0  # the dense MLP's share of `matmul` (0 in MoE layers)
    expert_matmul: float = 0.0  # MoE layers: the routed experts' top-k MLPs and the router
    shared_matmul: float = 0.0  # MoE layers: the shared experts' MLP
    mla_up_matmul: float = 0.0  # multi-latent attention: the up projections (q_b_proj / kv_b_proj)

    @property
    def total(self) -> float:
        return self.matmul + self.attention


def layer_forward_flops(spec: ModelSpec, index: int, seq_len: float) -> LayerFlops:
    """2 FLOPs per multiply-add: linear layers 2 x weights; QK^T and PV 2 x s x heads x (qk + v head widths), s the
    tokens each token attends to: the sequence, or over packed documents estimate/packed_attention.py's
    attended_tokens, and at most the layer's sliding window (GPT-OSS's sliding layers: 128 tokens)."""
    window = spec.attention_window(index)
    return _block_flops(spec, spec.is_moe_layer(index), seq_len if window is None else min(seq_len, window))


def _mla_matmul(spec: ModelSpec) -> tuple[int, int]:
    """Multiply-adds per token of multi-latent attention's projections (all of them, the up projections)."""
    h, heads, qk, v = spec.hidden_size, spec.num_attention_heads, spec.head_dim, spec.value_head_dim
    rank, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
    up = rank * heads * (qk - rope + v)  # kv_b_proj
    down = h * (rank + rope)  # kv_a_proj_with_mqa
    if spec.q_lora_rank:
        up += spec.q_lora_rank * heads * qk
        down += h * spec.q_lora_rank
    else:
        down += h * heads * qk  # q_proj, no compression
    return down + up + heads * v * h, up


@per_model
def _block_flops(spec: ModelSpec, moe: bool, seq_len: float) -> LayerFlops:
    h, hd, heads = spec.hidden_size, spec.head_dim, spec.num_attention_heads
    mla_up = 0
    if spec.mla:
        attn_linear, mla_up = _mla_matmul(spec)
    else:
        q, kv = heads * hd, spec.num_kv_heads * hd
        attn_linear = h * (q + 2 * kv) + q * h
    mats = 3 if spec.gated_mlp else 2
    shared = experts = 0
    if moe:
        experts = spec.experts_top_k * mats * h * spec.moe_ffn_hidden_size + h * spec.num_experts  # + router
        shared = mats * h * spec.shared_expert_ffn_hidden_size
        mlp = experts + shared
    else:
        mlp = mats * h * spec.ffn_hidden_size
    return LayerFlops(matmul=2.0 * (attn_linear + mlp), attention=2.0 * seq_len * heads * (hd + spec.value_head_dim),
                      mlp_matmul=0.0 if moe else 2.0 * mlp, expert_matmul=2.0 * experts, shared_matmul=2.0 * shared,
                      mla_up_matmul=2.0 * mla_up)


def head_forward_flops(spec: ModelSpec) -> float:
    return 2.0 * (spec.embed_proj_dim or spec.hidden_size) * spec.vocab_size


def mtp_projection_flops(spec: ModelSpec) -> float:
    """Forward FLOPs per token of one multi-token prediction module outside its block: eh_proj (2h -> h) and the
    shared output head."""
    return 2.0 * 2 * spec.hidden_size ** 2 + head_forward_flops(spec)


def mtp_forward_flops(spec: ModelSpec, seq_len: float) -> float:
    """Forward FLOPs per token of the multi-token prediction modules Megatron-Core trains (0 without any): each runs
    eh_proj (2h -> h), one block like the model's last, and the shared output head (transformers builds none)."""
    if not spec.mtp_layers:
        return 0.0
    block = layer_forward_flops(spec, spec.num_layers - 1, seq_len).total
    return spec.mtp_layers * (block + mtp_projection_flops(spec))


@per_model
def model_flops_per_token(spec: ModelSpec, seq_len: float, mtp: bool = False) -> float:
    """Forward + backward FLOPs of one token with no recomputation (the MFU numerator); `mtp`: with the
    multi-token prediction modules, where the backend trains them (Megatron-Core)."""
    forward = sum(layer_forward_flops(spec, i, seq_len).total for i in range(spec.num_layers))
    return 3.0 * (forward + head_forward_flops(spec) + (mtp_forward_flops(spec, seq_len) if mtp else 0.0))


def recomputed_forward(layer: LayerFlops, recompute: str, modules: tuple[str, ...], checkpointed: bool) -> LayerFlops:
    """The part of a block's forward that activation recomputation runs again in backward (hardware, not model,
    FLOPs): the whole block when full recompute checkpoints it, else Megatron-Core's selective modules (core
    attention: the s^2 term; mlp: the dense MLP's matmuls; moe: the MoE layer's, shared experts included;
    shared_experts: theirs; mla_up_proj: MLA's up projections; moe_act and layernorm recompute no matmul)."""
    if recompute == "full":
        return layer if checkpointed else LayerFlops(0.0, 0.0)
    if recompute == "selective":
        mlp = layer.mlp_matmul if "mlp" in modules else 0.0
        if "moe" in modules:
            mlp += layer.expert_matmul + layer.shared_matmul
        elif "shared_experts" in modules:
            mlp += layer.shared_matmul
        up = layer.mla_up_matmul if "mla_up_proj" in modules else 0.0
        return LayerFlops(matmul=mlp + up, attention=layer.attention if "core_attn" in modules else 0.0, mlp_matmul=mlp)
    return LayerFlops(0.0, 0.0)


def six_n_flops_per_token(spec: ModelSpec) -> float:
    """The 6N rule of thumb (Kaplan et al., arXiv:2001.08361) over active non-embedding parameters, for comparison."""
    counts = count_params(spec)
    return 6.0 * (counts.active - counts.embedding)
