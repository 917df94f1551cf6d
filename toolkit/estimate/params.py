"""Exact parameter counts of a ModelSpec, split the way parallelism shards them."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from toolkit.spec.model import ModelSpec, per_model
from toolkit.spec.pipeline import PipelineSplit

KINDS_ENTRIES = 65536  # (split, stage) pairs one model's counts remember: a search's, not a process's


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
    mtp_layers: tuple[LayerParams, ...] = ()  # multi-token prediction modules' blocks
    mtp_eh_proj: int = 0  # their eh_proj (2h -> h, column parallel), summed over the modules
    mtp_norms: int = 0  # their enorm, hnorm and final norm
    # kinds_of's answers: the same model's layer groups are asked of every plan a search tries
    _kinds: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def kinds_of(self, split: PipelineSplit, stage: int) -> tuple[tuple[LayerParams, int], ...]:
        """The distinct blocks pipeline rank `stage` holds under `split`, each with how many of them it holds (in the
        order they first occur): all a sum over the rank's layers' parameters needs."""
        hit = self._kinds.get((split, stage))
        if hit is None:
            kinds: dict[LayerParams, int] = {}
            for index in split.stage_layers(stage):
                layer = self.layers[index]
                kinds[layer] = kinds.get(layer, 0) + 1
            if len(self._kinds) >= KINDS_ENTRIES:
                self._kinds.clear()
            hit = self._kinds[(split, stage)] = tuple(kinds.items())
        return hit

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

    @property
    def mtp(self) -> int:
        """Parameters of the multi-token prediction modules, which `total` leaves out as transformers' model does
        (it builds none); Megatron-Core builds and trains them, sharing the embedding and the output head."""
        return sum(layer.total for layer in self.mtp_layers) + self.mtp_eh_proj + self.mtp_norms

    @property
    def mtp_active(self) -> int:
        inactive = sum((self.num_experts - self.experts_top_k) * layer.expert_one for layer in self.mtp_layers
                       if layer.experts)
        return self.mtp - inactive


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


def _mla_params(spec: ModelSpec) -> tuple[int, int]:
    """(sharded, replicated) parameters of multi-latent attention (transformers' DeepseekV3Attention): the up
    projections and the output split across tensor-parallel ranks (Megatron-Core's MLA column/row parallel), the down
    projections and their norms do not (Megatron-Core duplicates them on every TP rank)."""
    h, heads, qk = spec.hidden_size, spec.num_attention_heads, spec.head_dim
    rank, rope, v = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.value_head_dim
    bias = spec.qkv_bias  # attention_bias: q_a_proj and kv_a_proj_with_mqa (o_proj's is attn_out_bias)
    sharded = rank * heads * (qk - rope + v) + heads * v * h  # kv_b_proj, o_proj
    replicated = h * (rank + rope) + (rank + rope if bias else 0) + _norm_params(spec, rank)  # kv_a_proj, kv_a norm
    if spec.q_lora_rank:
        q = spec.q_lora_rank
        sharded += q * heads * qk  # q_b_proj
        replicated += h * q + (q if bias else 0) + _norm_params(spec, q)  # q_a_proj, q_a_layernorm
    else:
        sharded += h * heads * qk  # q_proj
    return sharded, replicated


@per_model
def _block_params(spec: ModelSpec, moe: bool) -> LayerParams:
    h, hd = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * hd, spec.num_kv_heads * hd
    replicated = spec.norms_per_layer * _norm_params(spec, h)
    if spec.mla:
        attention, mla_replicated = _mla_params(spec)
        replicated += mla_replicated
    else:
        attention = h * (q_out + 2 * kv_out) + q_out * h
        if spec.qkv_bias:
            attention += q_out + 2 * kv_out
    if spec.attention_sinks:
        attention += spec.num_attention_heads  # one sink logit per head, split with the heads
    if spec.attn_out_bias:
        replicated += h
    if spec.qk_norm:
        replicated += 2 * hd
    if moe:
        one_sharded, one_repl = _mlp_params(spec, spec.moe_ffn_hidden_size, bias=spec.expert_bias)
        expert_one = one_sharded + one_repl
        shared = sum(_mlp_params(spec, spec.shared_expert_ffn_hidden_size, bias=False))
        return LayerParams(
            attention_sharded=attention,
            mlp_sharded=shared,
            experts=spec.num_experts * expert_one,
            expert_one=expert_one,
            router=(h + spec.router_bias) * spec.num_experts,
            replicated=replicated,
        )
    mlp, mlp_repl = _mlp_params(spec, spec.ffn_hidden_size, bias=spec.mlp_bias)
    return LayerParams(attention, mlp, 0, 0, 0, replicated + mlp_repl)


@per_model
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
        mtp_layers=tuple(_block_params(spec, spec.is_moe_layer(spec.num_layers - 1)) for _ in range(spec.mtp_layers)),
        mtp_eh_proj=spec.mtp_layers * 2 * spec.hidden_size ** 2,
        mtp_norms=spec.mtp_layers * 3 * _norm_params(spec, spec.hidden_size),
    )
