"""Exact parameter counts of a ModelSpec, split the way parallelism shards them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from toolkit.spec.model import ModelSpec


@dataclass(frozen=True)
class LayerParams:
    """One transformer block. `*_sharded` parts split across tensor-parallel ranks, `replicated` parts do not."""

    attention_sharded: int  # q/k/v/o weights and q/k/v biases (column/row parallel)
    mlp_sharded: int  # dense MLP weights and its column-parallel biases
    experts: int  # all routed experts of the layer (split across expert-parallel ranks)
    expert_one: int  # one routed expert
    router: int
    replicated: int  # norms, qk-norm, row-parallel output biases

    @property
    def total(self) -> int:
        return self.attention_sharded + self.mlp_sharded + self.experts + self.router + self.replicated


@dataclass(frozen=True)
class ParamCounts:
    token_embedding: int
    position_embedding: int
    embed_proj: int  # opt project_in + project_out
    lm_head: int  # 0 when tied to the token embedding
    final_norm: int
    layers: tuple[LayerParams, ...]
    experts_top_k: int
    num_experts: int

    @cached_property
    def layers_total(self) -> int:
        return sum(layer.total for layer in self.layers)

    @property
    def embedding(self) -> int:
        """Parameters in embedding tables (what HF's `num_parameters(exclude_embeddings=True)` leaves out)."""
        return self.token_embedding + self.position_embedding

    @property
    def total(self) -> int:
        return self.embedding + self.embed_proj + self.lm_head + self.final_norm + self.layers_total

    @property
    def active(self) -> int:
        """Parameters one token passes through: MoE layers count only top-k of their experts."""
        inactive = sum((self.num_experts - self.experts_top_k) * layer.expert_one for layer in self.layers if layer.experts)
        return self.total - inactive


def _norm_params(spec: ModelSpec, width: int) -> int:
    if not spec.norm_affine:
        return 0
    return width * (2 if spec.norm == "layernorm" else 1)


def _mlp_params(spec: ModelSpec, ffn: int, bias: bool) -> tuple[int, int]:
    """(sharded, replicated) parameters of one MLP with inner size `ffn`."""
    h = spec.hidden_size
    in_mats = 2 if spec.gated_mlp else 1
    sharded = in_mats * h * ffn + ffn * h
    replicated = 0
    if bias:
        sharded += in_mats * ffn
        replicated += h
    return sharded, replicated


def layer_params(spec: ModelSpec, index: int) -> LayerParams:
    return _block_params(spec, spec.is_moe_layer(index))


@lru_cache(maxsize=1024)
def _block_params(spec: ModelSpec, moe: bool) -> LayerParams:
    h, hd = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * hd, spec.num_kv_heads * hd
    attention = h * (q_out + 2 * kv_out) + q_out * h
    if spec.qkv_bias:
        attention += q_out + 2 * kv_out
    replicated = spec.norms_per_layer * _norm_params(spec, h)
    if spec.attn_out_bias:
        replicated += h
    if spec.qk_norm:
        replicated += 2 * hd
    if moe:
        one_sharded, one_repl = _mlp_params(spec, spec.moe_ffn_hidden_size, bias=False)
        expert_one = one_sharded + one_repl
        return LayerParams(
            attention_sharded=attention,
            mlp_sharded=0,
            experts=spec.num_experts * expert_one,
            expert_one=expert_one,
            router=h * spec.num_experts,
            replicated=replicated,
        )
    mlp, mlp_repl = _mlp_params(spec, spec.ffn_hidden_size, bias=spec.mlp_bias)
    return LayerParams(attention, mlp, 0, 0, 0, replicated + mlp_repl)


@lru_cache(maxsize=256)
def count_params(spec: ModelSpec) -> ParamCounts:
    emb_dim = spec.embed_proj_dim or spec.hidden_size
    token_embedding = spec.vocab_size * emb_dim
    return ParamCounts(
        token_embedding=token_embedding,
        position_embedding=spec.position_embedding_rows * spec.hidden_size if spec.position_embedding == "learned" else 0,
        embed_proj=2 * spec.hidden_size * spec.embed_proj_dim if spec.embed_proj_dim else 0,
        lm_head=0 if spec.tie_embeddings else token_embedding,
        final_norm=_norm_params(spec, spec.hidden_size) if spec.final_norm else 0,
        layers=tuple(layer_params(spec, i) for i in range(spec.num_layers)),
        experts_top_k=spec.experts_top_k,
        num_experts=spec.num_experts,
    )
