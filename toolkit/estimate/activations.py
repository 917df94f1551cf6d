"""Activation bytes saved for backward, tensor by tensor, for HF modules and Megatron-Core modules (which a backend
trains is its declaration's `hf_modules`).

Every term below names the tensor autograd keeps. The HF terms were read off transformers' modules and checked
with `torch.autograd.graph.saved_tensors_hooks` (tests/unit/test_activation_measurement.py); the Megatron-Core
terms follow its Transformer Engine layer spec (LayerNormLinear saves input and ln_out, fused RoPE saves only
the frequencies, flash/cuDNN attention saves q, k, v, output and the fp32 log-sum-exp, bias-SwiGLU saves fc1's
output) and the accounting of Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198), Sec. 4, with dropout removed where the model has none.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from toolkit.spec.model import ModelSpec, moe_layer_flags, per_model
from toolkit.spec.options import FUSED_ATTENTION

FP32 = 4
MASK = 1  # dropout masks are bool tensors
INDEX = 8  # int64 token ids and labels

# HF activations implemented as several autograd ops (each keeps a tensor), by transformers' ACT2FN name.
# gelu_new / gelu_fast: 0.5*x*(1+tanh(c*(x+0.044715*x^3))) in Python keeps four ffn-wide tensors.
HF_MULTI_OP_GELU = ("gelu_new", "gelu_fast", "quick_gelu")
# HF families with a fused qkv projection whose sdpa path also keeps separate q and k tensors (measured).
HF_FUSED_QKV_SDPA_COPIES = ("gpt2", "phi3")
# HF families whose eager attention takes softmax in the compute dtype (the llama lineage upcasts to fp32); GPT-OSS's
# takes it over the scores and its sink column, in their dtype.
HF_EAGER_SOFTMAX_IN_COMPUTE_DTYPE = ("gpt2", "gpt_oss")


@dataclass(frozen=True)
class ActivationSetup:
    """What decides activation memory besides the architecture."""

    hf_modules: bool  # the HF model's own modules (else Megatron-Core's): the backend's declaration, Backend.hf_modules
    micro_batch: int
    seq_len: int
    act_bytes: int  # bytes of one activation element: 2 for bf16/fp16, 4 for fp32
    attention: str  # "sdpa" (fused, no s x s matrix kept) or "eager"
    recompute: str  # none | selective | full
    recompute_modules: tuple[str, ...] = ()  # selective: Megatron-Core's recompute_modules (core_attn, mlp)
    local_layers: bool = False  # Megatron-Core's `local` spec (no Transformer Engine): unfused attention, SwiGLU, norm
    tp: int = 1
    sequence_parallel: bool = False  # Megatron-Core's: norms, dropout and the checkpointed input split by tp
    cp: int = 1
    sp: int = 1  # Ulysses: each rank keeps 1/sp of the sequence, and attention runs on heads/sp of the whole sequence
    tiled_mlp: bool = False  # DeepSpeed's TiledMLP: the MLP keeps only its input; tiles recompute it in backward
    tiled_loss: bool = False  # DeepSpeed's TiledFusedLogitsLoss: no [s, vocab] logits kept, the input's grad instead
    offload_activations: bool = False  # checkpointed layer inputs kept in host memory (full recompute)
    ep: int = 1  # expert parallelism: the routed tokens' copies a rank receives
    expert_tp: int = 1  # expert tensor parallelism (Plan.expert_tp): the tokens of ETP ranks gathered on each
    routed_factor: float = 1.0  # the busiest expert rank's routed tokens over the mean (routed_token_factor)
    hf_activation: str | None = None  # transformers' hidden_act name, when known
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # bytes per element of what a Transformer Engine GEMM saves of its input in fp8 / fp4 (quantized, column-wise
    # usage only: spec/quantization.py); 0: the GEMMs save their 16-bit inputs themselves
    gemm_input_bytes: float = 0.0

    @property
    def saved_gemm_input(self) -> float:
        """Bytes per element a GEMM input costs when it is saved: its quantized copy, or the activation itself."""
        return self.gemm_input_bytes or self.act_bytes

    @property
    def tokens(self) -> int:
        """Tokens one rank processes per micro-batch (context parallelism splits the sequence)."""
        return self.micro_batch * self.seq_len // (self.cp * self.sp)


def _norm_bytes(spec: ModelSpec, a: int, width: int, megatron: bool, local: bool = False,
                saved: float | None = None) -> float:
    """Per token: what a norm keeps plus its output, which the next linear keeps; `megatron`: Megatron-Core's norm
    modules (`local`: its local spec's), else HF's. `saved`: bytes per element of the output the linear saves (TE's
    LayerNormLinear saves ln_out quantized in fp8 / fp4; default the activation's)."""
    if megatron and local and spec.norm == "rmsnorm":
        # torch's RMSNorm (no Apex): fp32 copy of the input, fp32 rstd, fp32 normalized copy; output for the linear
        return 2 * FP32 * width + FP32 + a * width
    if megatron:  # TE LayerNormLinear: input, ln_out, rstd (and mu for layernorm); torch's LayerNorm keeps the same
        return a * width + (saved or a) * width + FP32 * (2 if spec.norm == "layernorm" else 1)
    if spec.norm == "rmsnorm":  # HF RMSNorm: fp32 upcast, fp32 rstd, normalized copy kept by `weight *`, output
        return FP32 * width + FP32 + 2 * a * width
    return a * width + 2 * FP32 + a * width  # nn.LayerNorm: input, mean, rstd; output


def mlp_bytes_per_token(spec: ModelSpec, a: int, ffn: int, setup: ActivationSetup) -> int:
    """Per token, inside the tensor-parallel region (not yet divided by tp)."""
    if not setup.hf_modules and setup.local_layers and spec.gated_mlp:
        # unfused SwiGLU: fc1's output, silu's output, the second half multiplied, and fc2's input (measured on the
        # local spec with saved_tensors_hooks, tests/megatron/test_megatron_recompute.py)
        return 5 * a * ffn
    if not setup.hf_modules:
        # fc1 output (2*ffn when gated) kept by the fused activation, and fc2's input (quantized in fp8 / fp4)
        return a * (2 if spec.gated_mlp else 1) * ffn + setup.saved_gemm_input * ffn
    if spec.gated_mlp and spec.activation_clamp:
        # GPT-OSS's clamped SwiGLU (GptOssExperts._apply_gate): gate_up's output (2 x ffn, kept by both clamps), the
        # sigmoid's output, the clamped gate, glu and up + 1 (kept by their product), down_proj's input
        return 7 * a * ffn
    if spec.gated_mlp:  # gate output, act(gate), up output, act*up (down_proj's input)
        return 4 * a * ffn
    if spec.activation == "relu":  # relu keeps its output, which is also fc2's input
        return a * ffn
    if setup.hf_activation in HF_MULTI_OP_GELU:  # four tensors inside the activation, plus its output
        return 5 * a * ffn
    return 2 * a * ffn  # fused gelu keeps its input; fc2 keeps gelu's output


def mla_compressed_bytes(spec: ModelSpec, a: int, setup: ActivationSetup) -> int:
    """Per token, outside the tensor-parallel region: what multi-latent attention's compressed activations keep (0
    without MLA). The down projections are duplicated on every TP rank (Megatron-Core's MLA), so their outputs are
    whole there: the q and kv latents (q_lora_rank, kv_lora_rank wide) each go through an RMSNorm into an up
    projection; Megatron-Core's TE spec fuses that norm into the up projection (LayerNormColumnParallelLinear keeps
    its input and ln_out), HF's DeepseekV3RMSNorm keeps what any HF RMSNorm keeps (as _norm_bytes)."""
    if not spec.mla:
        return 0
    megatron = not setup.hf_modules
    widths = (spec.kv_lora_rank,) + ((spec.q_lora_rank,) if spec.q_lora_rank else ())
    return sum(_norm_bytes(spec, a, width, megatron, megatron and setup.local_layers) for width in widths)


def _mla_attention_bytes(spec: ModelSpec, a: int, setup: ActivationSetup) -> int:
    """Per token, inside the tensor-parallel region: what multi-latent attention keeps past its latents (the up
    projections' outputs, split by heads). Queries and keys are heads x (qk_nope + qk_rope) wide, values heads x
    v_head_dim: a fused kernel keeps q, k, v, its output and the fp32 log-sum-exp (HF's values are a view of kv_b_proj's
    output, heads x (qk_nope + v), kept whole); eager attention keeps q, k, v and the probabilities; the output
    projection keeps its heads x v_head_dim input."""
    heads, s = spec.num_attention_heads, setup.seq_len // setup.cp
    qk, v = heads * spec.head_dim, heads * spec.value_head_dim
    kept_v = heads * (spec.head_dim - spec.qk_rope_head_dim) + v if setup.hf_modules else v
    out = a * v
    if "mla_up_proj" in setup.recompute_modules and not setup.hf_modules:
        # Megatron-Core recomputes the up projections in backward (CheckpointWithoutOutput): q, k, v are not kept,
        # the latents they come from are (mla_compressed_bytes)
        return FP32 * heads + out
    if setup.attention in FUSED_ATTENTION or "core_attn" in setup.recompute_modules:
        return a * (2 * qk + kept_v) + FP32 * heads + out
    probs = a * heads * s + (FP32 * heads * s if a != FP32 else 0)
    return a * (2 * qk + kept_v) + probs + out


def _attention_bytes(spec: ModelSpec, a: int, setup: ActivationSetup) -> int:
    """Per token, inside the tensor-parallel region: what attention keeps, and o_proj's input."""
    if spec.mla:
        return _mla_attention_bytes(spec, a, setup)
    q = spec.num_attention_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    heads, s = spec.num_attention_heads, setup.seq_len // setup.cp
    hf = setup.hf_modules
    out = a * q  # attention output, kept by o_proj
    # in fp8 / fp4 the output projection saves its own quantized copy beside the fused kernel's bf16 output
    proj_copy = setup.gemm_input_bytes * q
    qk_norm = 0
    if spec.qk_norm and hf:  # HF per-head RMSNorm on q and k, as _norm_bytes for rmsnorm
        qk_norm = (FP32 + 2 * a) * (q + kv) + FP32 * (heads + spec.num_kv_heads)
    elif spec.qk_norm and setup.local_layers:
        # Megatron-Core's local q/k layernorm (torch's RMSNorm on a contiguous q and on k, a view of the fused QKV
        # output): an fp32 copy of the input, the fp32 normalized copy and rstd per head; in fp32 the "copy" of k is
        # the view itself, which keeps the whole QKV output alive (measured, tests/megatron/test_megatron_recompute.py)
        qk_norm = 2 * FP32 * (q + kv) + FP32 * (heads + spec.num_kv_heads) + (FP32 * (q + kv) if a == FP32 else 0)
    elif spec.qk_norm:
        # Transformer Engine's RMSNorm keeps its input (a view of the fused QKV output, which so stays whole) and rstd
        qk_norm = a * (q + 2 * kv) + FP32 * (heads + spec.num_kv_heads)
    core_attn = "core_attn" in setup.recompute_modules
    if setup.local_layers and not core_attn:
        # Megatron-Core's DotProductAttention: k and v repeated to every head, QK^T, the causal mask (s x s bool, one
        # per micro-batch), softmax in fp32 and its compute-dtype copy for PV, the context for the output projection
        probs = FP32 * heads * s + (a * heads * s if a != FP32 else 0)
        mask = MASK * s / setup.micro_batch
        return qk_norm + a * 3 * q + probs + mask + out
    if setup.attention in FUSED_ATTENTION or core_attn:  # flash attention keeps what sdpa's fused kernel keeps
        if core_attn:
            # Megatron recomputes core attention; its checkpoint keeps the inputs: rotated q and k, and v, a view of
            # the fused QKV projection's output, which so stays whole (measured on the local spec)
            return qk_norm + a * (q + kv) + a * (q + 2 * kv) + (proj_copy or out)
        if setup.sp > 1:
            # Ulysses: the kernel keeps q, k, v after the all-to-all ([s, heads/sp]: as many bytes as [s/sp, heads]);
            # the sequence-sharded ones go with the all-to-all, which keeps nothing. With fewer kv heads than sp each
            # rank gets one kv head replicated (UlyssesSPAttentionHF kv_replication_factor)
            saved_qkv = a * (q + 2 * kv * ulysses_kv_copies(spec, setup.sp))
        elif hf and spec.family in HF_FUSED_QKV_SDPA_COPIES:
            # v is a view of the fused [q|k|v] output, kept whole; q and k are separate (rotated or made contiguous)
            saved_qkv = a * (q + 2 * kv) + a * (q + kv)
        else:
            saved_qkv = a * (q + 2 * kv)
        return qk_norm + saved_qkv + FP32 * heads + out + proj_copy  # + the fused kernel's fp32 log-sum-exp
    # eager: QK^T and PV keep q, k, v (k and v repeated to all heads for GQA) and the probabilities
    kv_kept = kv if spec.num_kv_heads == heads else q
    probs = a * heads * s
    if not (hf and spec.family in HF_EAGER_SOFTMAX_IN_COMPUTE_DTYPE) and a != FP32:
        probs += FP32 * heads * s  # softmax in fp32, then a compute-dtype copy for PV
    if setup.attention_dropout > 0:
        probs += MASK * heads * s
    return qk_norm + a * (q + 2 * kv_kept) + probs + out


def routed_token_factor(ep: int, imbalance: float, capacity_factor: float | None = None) -> float:
    """The routed tokens the busiest expert-parallel rank receives over the mean: the plan's imbalance, capped at ep
    (one rank can receive every routed token of its EP group, no more) and, with token dropping, at the capacity
    factor (Megatron-Core drops what exceeds ceil(tokens x k / experts x capacity_factor) per expert,
    moe_utils.get_capacity)."""
    factor = min(imbalance, float(ep))
    return min(factor, capacity_factor) if capacity_factor else factor


def moe_bytes_per_token(spec: ModelSpec, setup: ActivationSetup) -> dict[str, float]:
    """What one Megatron-Core MoE layer keeps for backward beyond its norm, term by term, per token of the rank's
    micro-batch inside the tensor-parallel region (not yet divided by tp, as the block's other terms). Read from
    Megatron-Core 0.16.1's transformer/moe/ and measured on its local spec (tests/megatron/test_megatron_recompute.py):
    - router: the fp32 softmax over every expert that the auxiliary loss keeps, the top-k probabilities' fp32 softmax
      and their int64 indices (router.py, moe_utils.topk_routing_with_score_function);
    - permutation: the token dispatcher's routing map (bool) and probabilities transposed to [experts, tokens], and
      the int64 indices that sort the k copies of each token by expert (moe_utils.permute);
    - routed experts: per copy a rank receives (k x the imbalance factor, and the tokens of its ETP group gathered),
      the permuted hidden state fc1 keeps, its probability, and the expert MLP's activations (Transformer Engine's
      fused weighted SwiGLU keeps fc1's output, fc2 keeps its input; the local spec's unfused SwiGLU and its
      probability product keep more), over ETP;
    - shared experts: a dense MLP every token passes (its input is the norm's output, counted with the norm).
    Recompute modules remove what they checkpoint: `moe` the whole layer (its input stays, the norm's output),
    `moe_act` the activation's output (fc2's input), `shared_experts` the shared MLP."""
    a, h = setup.act_bytes, spec.hidden_size
    k, e, ffn = spec.experts_top_k, spec.num_experts, spec.moe_ffn_hidden_size
    modules = setup.recompute_modules
    if "moe" in modules:
        return {"router": 0.0, "permutation": 0.0, "routed_experts": 0.0, "shared_experts": 0.0}
    expert_mlp = mlp_bytes_per_token(spec, a, ffn, setup)
    if setup.local_layers:
        expert_mlp += a * ffn  # SequentialMLP's MLP multiplies the activation by the probability: it keeps both
    if "moe_act" in modules:
        expert_mlp -= a * ffn
    copies = k * setup.routed_factor
    shared_ffn = spec.shared_expert_ffn_hidden_size
    shared = 0 if not shared_ffn or "shared_experts" in modules else mlp_bytes_per_token(spec, a, shared_ffn, setup)
    return {
        "router": FP32 * e + (FP32 + INDEX) * k,
        "permutation": (MASK + a) * e + INDEX * k,
        "routed_experts": copies * (setup.expert_tp * (a * h + a) + expert_mlp),
        "shared_experts": float(shared),
    }


def mtp_bytes_per_token(spec: ModelSpec, setup: ActivationSetup) -> float:
    """Per token of the last stage, what Megatron-Core's multi-token prediction modules keep (0 without any, or on
    the HF modules, which drop them): each module's enorm and hnorm, eh_proj's input (the two normalized halves
    concatenated), one block like the model's last, and its own pass through the shared head and loss."""
    if not spec.mtp_layers or setup.hf_modules:
        return 0.0
    h, a = spec.hidden_size, setup.act_bytes
    norms = 2 * _norm_bytes(spec, a, h, True, setup.local_layers) / (setup.tp if setup.sequence_parallel else 1)
    block = _block_bytes_per_token(spec, spec.is_moe_layer(spec.num_layers - 1), setup)
    return spec.mtp_layers * (norms + 2 * a * h + block + head_bytes_per_token(spec, setup))


def ulysses_kv_copies(spec: ModelSpec, sp: int) -> float:
    """How many times the kv heads' bytes per token grow after Ulysses' all-to-all: sp / kv heads when sp exceeds them
    (each rank then holds one kv head over the whole sequence), else 1."""
    return max(1.0, sp / spec.num_kv_heads)


@per_model
def _block_bytes_per_token(spec: ModelSpec, moe: bool, setup: ActivationSetup) -> float:
    """Bytes one transformer block (MoE or dense) keeps for backward, per token of the micro-batch, on one rank."""
    a, h = setup.act_bytes, spec.hidden_size
    megatron = not setup.hf_modules
    tp = setup.tp
    norm_split = tp if (megatron and setup.sequence_parallel) else 1
    local = megatron and setup.local_layers
    saved = setup.saved_gemm_input if megatron else None
    norms = spec.norms_per_layer * _norm_bytes(spec, a, h, megatron, local, saved) if spec.norms_per_layer else 0
    if spec.norms_per_layer > 2:  # gemma2's post-norms: their output goes to the residual, not a linear
        norms -= (spec.norms_per_layer - 2) * a * h
    if megatron and not moe and "mlp" in setup.recompute_modules:
        # Megatron-Core checkpoints the dense MLP (TE's fc1 LayerNormLinear holds the pre-MLP norm): only the MLP's
        # input, the residual stream, stays; the norm's input and output, fc1's output and fc2's input go. The local
        # spec's norm is a module of its own: it keeps what it keeps, and its output is the checkpoint's input.
        if not local:
            norms -= _norm_bytes(spec, a, h, megatron, saved=saved) - a * h
        mlp = 0
    elif setup.tiled_mlp and not moe:
        mlp = 0  # TiledMLP keeps only the MLP's input: the norm's output, counted with the norm
    elif moe and megatron:
        mlp = sum(moe_bytes_per_token(spec, setup).values())
    elif moe:
        k, e = spec.experts_top_k, spec.num_experts
        # router: logits (fp32 softmax output) per expert; per chosen expert the token's hidden copy, its MLP, and the
        # expert's output that the routing weight multiplies (kept for the weight's gradient); the shared experts
        # (DeepSeek-V3) are a dense MLP every token passes
        shared = spec.shared_expert_ffn_hidden_size
        mlp = (FP32 * e + k * (2 * a * h + mlp_bytes_per_token(spec, a, spec.moe_ffn_hidden_size, setup))
               + (mlp_bytes_per_token(spec, a, shared, setup) if shared else 0))
    else:
        mlp = mlp_bytes_per_token(spec, a, spec.ffn_hidden_size, setup)
    dropout = 2 * MASK * h if setup.hidden_dropout > 0 else 0
    return (norms / norm_split + (_attention_bytes(spec, a, setup) + mlp) / tp + dropout / norm_split
            + mla_compressed_bytes(spec, a, setup))


def head_bytes_per_token(spec: ModelSpec, setup: ActivationSetup) -> float:
    """Final norm, the fp32 logits cross-entropy keeps, and token ids / labels."""
    a = setup.act_bytes
    megatron = not setup.hf_modules
    norm = (_norm_bytes(spec, a, spec.hidden_size, megatron, megatron and setup.local_layers) if spec.final_norm
            else a * spec.hidden_size)
    if megatron and setup.sequence_parallel:
        norm /= setup.tp
    if setup.tiled_loss:
        # TiledFusedLogitsLoss runs backward tile by tile inside forward and keeps the input's gradient (compute dtype)
        # in place of the norm output lm_head would keep; no logits stay
        return norm + INDEX
    return norm + fp32_logits_bytes_per_token(spec, setup) + INDEX  # the softmax / log-softmax output


def fp32_logits_bytes_per_token(spec: ModelSpec, setup: ActivationSetup) -> float:
    """One fp32 copy of a token's logits (its vocabulary shard under TP): the unit of the loss's memory terms."""
    return FP32 * spec.vocab_size / setup.tp


def embedding_bytes_per_token(spec: ModelSpec, setup: ActivationSetup) -> float:
    dropout = MASK * spec.hidden_size if setup.hidden_dropout > 0 else 0
    return INDEX + dropout


def checkpointed_layer_bytes_per_token(spec: ModelSpec, setup: ActivationSetup) -> float:
    """Full recompute keeps only each block's input (sequence-parallel in Megatron with SP)."""
    split = setup.tp if (not setup.hf_modules and setup.sequence_parallel) else 1
    return setup.act_bytes * spec.hidden_size / split


def stage_activation_bytes(
    spec: ModelSpec,
    setup: ActivationSetup,
    alive_layers: Sequence[int],
    embedding_forwards: int,
    last_stage: bool,
    recomputed: Collection[int] | None = None,
) -> int:
    """Peak activation bytes of one pipeline rank.

    `alive_layers` names a layer once for every forward pass whose activations the rank still holds at its peak
    (a layer of a chunk with three micro-batches in flight appears three times); `embedding_forwards` counts those
    passes that went through the embedding. Under full recompute `recomputed` names the layers checkpointed
    (Megatron-Core's block method); None means all of them.
    """
    kept, working = _kept_and_working(spec, setup, alive_layers, embedding_forwards, recomputed)
    total = (kept + working) * setup.tokens
    if last_stage:  # the head's activations live only from the last forward to its backward: one micro-batch
        total += (head_bytes_per_token(spec, setup) + mtp_bytes_per_token(spec, setup)) * setup.tokens
    return int(total)


def recompute_working_bytes(spec: ModelSpec, setup: ActivationSetup, alive_layers: Sequence[int],
                            recomputed: Collection[int] | None = None) -> int:
    """The part of stage_activation_bytes that lives only in the layers' backward: the one block full recompute runs
    again at a time (0 without full recompute)."""
    return int(_kept_and_working(spec, setup, alive_layers, 0, recomputed)[1] * setup.tokens)


def _kept_and_working(spec: ModelSpec, setup: ActivationSetup, alive_layers: Sequence[int], embedding_forwards: int,
                      recomputed: Collection[int] | None) -> tuple[float, float]:
    """Bytes per token kept through the step, and of the block backward recomputes (stage_activation_bytes)."""
    full = setup.recompute == "full"
    if not full or recomputed is None or isinstance(recomputed, frozenset):
        checkpoints = recomputed if full else None
    else:
        checkpoints = frozenset(recomputed)
    layers, kinds, every_one_checkpointed, checkpointed_forwards = _alive_structure(
        spec, alive_layers if isinstance(alive_layers, tuple) else tuple(alive_layers), checkpoints, full)
    block_bytes = {moe: _block_bytes_per_token(spec, moe, setup) for moe in kinds}
    checkpoint = checkpointed_layer_bytes_per_token(spec, setup)
    kept = working = 0.0
    for moe, n, checkpointed in layers:
        layer = block_bytes[moe]
        if checkpointed:
            kept += checkpoint * n
            working = max(working, layer)  # backward recomputes one block at a time, for one micro-batch
        else:
            kept += layer * n
    if not every_one_checkpointed:
        # block method: a chunk's checkpointed layers come first, so by the time backward recomputes one of them the
        # micro-batch's later, fully kept layers (at least as large) have been freed
        working = 0.0
    if setup.offload_activations and checkpointed_forwards:
        # the checkpointed inputs live in host memory (offloaded_activation_bytes); the one being copied stays
        kept -= checkpointed_layer_bytes_per_token(spec, setup) * (checkpointed_forwards - 1)
    kept += embedding_bytes_per_token(spec, setup) * embedding_forwards
    return kept, working


@per_model
def _alive_structure(spec: ModelSpec, alive_layers: tuple[int, ...], recomputed: Collection[int] | None,
                     full: bool) -> tuple[tuple[tuple[bool, int, bool], ...], frozenset[bool], bool, int]:
    """What _kept_and_working needs of the alive layers, the same for every plan with the same ones: each distinct
    layer (in the order it first occurs) as (an MoE layer?, forwards alive, checkpointed by full recompute?); the
    kinds among them (MoE or not); whether every one is checkpointed; and the forwards of checkpointed layers
    alive."""
    by_layer = Counter(alive_layers)
    checkpointed = {i for i in by_layer if recomputed is None or i in recomputed} if full else set()
    moe_flags = moe_layer_flags(spec)
    layers = tuple((moe_flags[i], n, i in checkpointed) for i, n in by_layer.items())
    return (layers, frozenset(moe for moe, _, _ in layers), len(checkpointed) == len(by_layer),
            sum(by_layer[i] for i in checkpointed))


def offloaded_activation_bytes(spec: ModelSpec, setup: ActivationSetup, alive_layers: Sequence[int],
                               recomputed: Collection[int] | None = None) -> int:
    """Host bytes of one rank's checkpointed layer inputs with activation offload (0 without it): every checkpointed
    layer's input but the one in flight, which stage_activation_bytes leaves on the GPU."""
    if not setup.offload_activations or setup.recompute != "full":
        return 0
    count = sum(1 for i in alive_layers if recomputed is None or i in recomputed)
    return int(checkpointed_layer_bytes_per_token(spec, setup) * max(0, count - 1) * setup.tokens)
