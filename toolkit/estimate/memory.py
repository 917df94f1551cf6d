"""Per-GPU training memory (weights, gradients, optimizer, activations, overhead) of a model under a plan.

Pure arithmetic: no process group, no GPU. Byte rules and their sources:
- ZeRO stages partition optimizer states (1), + gradients (2), + parameters (3) over data parallel ranks; mixed
  precision Adam keeps K = 12 bytes/param of fp32 master weights and moments (Rajbhandari et al., "ZeRO",
  arXiv:1910.02054, Sec. 3-5: (2 + 2 + K) x Psi / Nd).
- Megatron keeps fp32 gradient buffers for bf16 training and its distributed optimizer shards the fp32 master
  weights and Adam moments over the data-parallel (x context-parallel) group: 6 + 12/d bytes/param
  (Megatron-LM docs/source/api-guide/dist_optimizer.md, "bf16 param, fp32 grads").
- DeepSpeed bucket defaults: reduce_bucket_size and allgather_bucket_size 5e8 elements, stage3 prefetch bucket
  5e7, max live parameters 1e9 (deepspeed/runtime/zero/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from toolkit.estimate.activations import ActivationSetup, stage_activation_bytes
from toolkit.estimate.fsdp import GATHERED_LAYERS, fsdp_groups, fsdp_model_states
from toolkit.estimate.lora import NF4_BYTES, adapter_activation_bytes, finetune_counts
from toolkit.estimate.params import ParamCounts, count_params, megatron_padded_vocab
from toolkit.estimate.pipeline import peak_forwards
from toolkit.numeric import GiB
from toolkit.spec.model import ModelSpec
from toolkit.spec.pipeline import PipelineSplit
from toolkit.spec.plan import PRECISION_BYTES, Plan

FP32 = 4

# Outside what PyTorch's allocator reports: CUDA context, cuBLAS/cuDNN workspaces, NCCL channel buffers.
# Typical on H100 with CUDA 12: 500-700 MiB per process; we budget 0.75 GiB.
CUDA_CONTEXT_BYTES = int(0.75 * GiB)
# Caching-allocator fragmentation: reserved exceeds allocated by a few percent in steady training.
ALLOCATOR_MARGIN = 0.05

DS_REDUCE_BUCKET_ELEMENTS = 500_000_000
DS_ALLGATHER_BUCKET_ELEMENTS = 500_000_000
DS_STAGE3_PREFETCH_ELEMENTS = 50_000_000
DS_STAGE3_MAX_LIVE_PARAMETERS = 1_000_000_000
# ZeRO-3 keeps a parameter of at most this many elements gathered on every rank, next to its partition
# (stage3_param_persistence_threshold, deepspeed/runtime/zero/config.py): LoRA's A and B matrices mostly are
DS_STAGE3_PERSISTENCE_THRESHOLD = 100_000
# ZeRO-1/2 allocate their gradient buckets at full reduce_bucket_size, twice with overlap_comm (double buffering,
# stage_1_and_2.py setup_buckets); the generated configs turn overlap_comm on.
DS_OVERLAP_COMM = True
# Transformer Engine keeps an fp8 copy of each linear weight next to the bf16 one.
FP8_WEIGHT_CACHE_BYTES = 1

# Optimizer bytes per parameter: (with low-precision weights: fp32 master + states, with fp32 weights: states only)
OPTIMIZER_BYTES = {"adamw": (12, 8), "sgd": (8, 4), "adamw8bit": (6, 2)}


@dataclass(frozen=True)
class StageParams:
    """Parameters resident on one rank of a pipeline stage, before any ZeRO / distributed-optimizer sharding."""

    dense: int  # replicated across data parallel ranks
    expert: int  # replicated across expert-data-parallel ranks only

    @property
    def total(self) -> int:
        return self.dense + self.expert


@dataclass(frozen=True)
class MemoryBreakdown:
    weights: int
    gradients: int
    optimizer: int
    activations: int
    overhead: int
    overhead_detail: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0  # CPU RAM per GPU needed by offload
    stage: int = 0  # the pipeline stage this breakdown belongs to (the most loaded one)
    params_on_gpu: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.overhead

    def as_dict(self) -> dict[str, int]:
        return dict(
            weights=self.weights,
            gradients=self.gradients,
            optimizer=self.optimizer,
            activations=self.activations,
            overhead=self.overhead,
            total=self.total,
        )


def stage_layers(num_layers: int, plan: Plan, stage: int) -> list[int]:
    """Layer indices held by pipeline rank `stage` over all its virtual stages (Megatron-Core's split)."""
    return PipelineSplit.of(num_layers, plan).stage_layers(stage)


def stage_params(spec: ModelSpec, counts: ParamCounts, plan: Plan, stage: int) -> StageParams:
    tp = plan.tp
    dense = expert = 0
    for index in stage_layers(spec.num_layers, plan, stage):
        layer = counts.layers[index]
        dense += (layer.attention_sharded + layer.mlp_sharded) // tp + layer.replicated + layer.router
        expert += layer.experts // (plan.ep * tp)
    emb_dim = counts.token_embedding // spec.vocab_size
    vocab = megatron_padded_vocab(spec.vocab_size, tp) if plan.backend == "megatron" else spec.vocab_size
    vocab_shard = vocab * emb_dim // tp
    first, last = stage == 0, stage == plan.pp - 1
    if first:
        dense += vocab_shard + counts.position_embedding + counts.embed_proj
    if last:
        dense += counts.final_norm
        if counts.lm_head:
            dense += vocab_shard
        elif plan.pp > 1:  # tied head on another stage keeps its own copy of the embedding
            dense += vocab_shard
    return StageParams(dense=dense, expert=expert)


def alive_forwards(spec: ModelSpec, plan: Plan, stage: int) -> tuple[list[int], int]:
    """(layers once per forward alive at the rank's peak, forwards through the embedding) under Megatron's schedule.

    DeepSpeed's pipeline engine runs the same 1F1B order as Megatron's non-interleaved schedule.
    """
    chunks = PipelineSplit.of(spec.num_layers, plan).chunks()[stage]
    forwards = peak_forwards(plan.pp, plan.vpp, stage, plan.grad_accum)
    alive = [layer for chunk in forwards for layer in chunks[chunk]]
    return alive, forwards.count(0) if stage == 0 else 0


def recomputed_layers(spec: ModelSpec, plan: Plan, stage: int) -> frozenset[int] | None:
    """Layers of a rank whose activations full recompute drops: the first recompute_num_layers of every model chunk
    (Megatron-Core's block method, TransformerBlock._checkpointed_forward); None: every layer (or no full recompute)."""
    if plan.recompute != "full" or plan.recompute_num_layers is None:
        return None
    chunks = PipelineSplit.of(spec.num_layers, plan).chunks()[stage]
    return frozenset(layer for chunk in chunks for layer in chunk[: plan.recompute_num_layers])


def activation_setup(spec: ModelSpec, plan: Plan) -> ActivationSetup:
    return ActivationSetup(
        backend=plan.backend,
        micro_batch=plan.micro_batch,
        seq_len=plan.seq_len,
        act_bytes=PRECISION_BYTES[plan.precision],
        attention=plan.attention,
        recompute=plan.recompute,
        recompute_modules=plan.recompute_modules,
        local_layers=plan.transformer_impl == "local",
        tp=plan.tp,
        sequence_parallel=plan.sequence_parallel,
        cp=plan.cp,
        hf_activation=spec.hf_activation,
        hidden_dropout=spec.hidden_dropout,
        attention_dropout=spec.attention_dropout,
    )


def _model_states(spec: ModelSpec, plan: Plan, params: StageParams, layer_params: int) -> tuple[int, int, int, dict, int]:
    """(weights, gradients, optimizer, comm buffers, host bytes) on one GPU."""
    w = PRECISION_BYTES[plan.precision]
    mixed = plan.precision != "fp32"
    if plan.finetune.peft:
        return _frozen_base_states(spec, plan, params, layer_params)
    if plan.backend == "fsdp":  # fp32 shards are their own master copy: the optimizer keeps its states only
        groups = fsdp_groups(count_params(spec), params.total, layer_params, plan.tp)
        return fsdp_model_states(plan, groups, OPTIMIZER_BYTES[plan.optimizer][1])
    opt_bytes = OPTIMIZER_BYTES[plan.optimizer][0 if mixed else 1]
    dense, expert = params.dense, params.expert
    buffers: dict[str, int] = {}
    host = 0
    if plan.backend == "megatron":
        weights = params.total * (w + (FP8_WEIGHT_CACHE_BYTES if plan.precision == "fp8" else 0))
        gradients = params.total * FP32  # fp32 main-grad buffers (grad_reduce_in_fp32)
        if plan.distributed_optimizer:
            optimizer = opt_bytes * (dense / (plan.dp * plan.cp) + expert / plan.expert_dp)
        else:
            optimizer = opt_bytes * params.total
        return weights, gradients, int(optimizer), buffers, host

    dp = plan.dp
    partition = dense / dp + expert / max(plan.expert_dp, 1)
    weights = params.total * w
    if plan.zero == 0:
        # bf16: DeepSpeed's BF16_Optimizer accumulates into fp32 gradients; fp16/fp32: gradients in weight dtype
        gradients = params.total * (FP32 if plan.precision == "bf16" else w)
    else:
        # ZeRO-1 as ZeRO-2: with contiguous_gradients (the default) DeepSpeed copies only this rank's partition into
        # grads_in_partition after the reduce buckets (stage_1_and_2.py), so no full gradient copy stays resident
        gradients = partition * w
    optimizer = opt_bytes * (params.total if plan.zero == 0 else partition)
    if plan.zero in (1, 2):
        buffers["reduce_buckets"] = DS_REDUCE_BUCKET_ELEMENTS * w * (2 if DS_OVERLAP_COMM else 1)
        buffers["allgather_bucket"] = min(DS_ALLGATHER_BUCKET_ELEMENTS, params.total) * w
    if plan.zero == 3:
        weights = partition * w
        live = min(DS_STAGE3_MAX_LIVE_PARAMETERS, 2 * layer_params)  # gathered layers in use or prefetched
        buffers["stage3_live_params"] = live * w
        buffers["stage3_prefetch_bucket"] = min(DS_STAGE3_PREFETCH_ELEMENTS, params.total) * w
        buffers["reduce_bucket"] = DS_REDUCE_BUCKET_ELEMENTS * w  # allocated whole at init and kept (stage3.py)
        if plan.offload_params != "none":
            host += weights if plan.offload_params == "cpu" else 0
            weights = 0
    if plan.offload_optimizer != "none":
        # ZeRO-Offload keeps fp32 master weights, moments and fp32 gradient partitions on the host
        if plan.offload_optimizer == "cpu":
            host += int(optimizer + partition * FP32)
        optimizer = 0
    return int(weights), int(gradients), int(optimizer), {k: int(v) for k, v in buffers.items()}, int(host)


def _frozen_base_states(spec: ModelSpec, plan: Plan, params: StageParams, layer_params: int) -> tuple[int, int, int, dict, int]:
    """(weights, gradients, optimizer, comm buffers, host bytes) on one GPU when LoRA adapters train on a frozen base.

    The base keeps its stored precision (bf16, or nf4 with its block scales for qlora) and is sharded only where the
    plan shards parameters (ZeRO-3, FSDP2); gradients, optimizer states and fp32 masters exist for the adapters only.
    DeepSpeed casts the whole module, adapters included, to the training dtype; Accelerate's FSDP2 preparation upcasts
    the trainable adapters to fp32 (their own master copy) and leaves the frozen base as loaded (bf16; a 4-bit base
    as bitsandbytes packed it, in bnb_4bit_quant_storage = the training dtype). bitsandbytes' block scales are
    buffers of the quantisation state, not parameters: no sharding divides them.
    """
    w = PRECISION_BYTES[plan.precision]
    counts = finetune_counts(spec, plan.finetune)
    adapters, quantized = counts.adapters, counts.quantized
    base = params.total  # deepspeed and fsdp plans hold the whole model per stage (pp = tp = 1)
    packed = (base - quantized) * w + quantized * 0.5  # parameters: bf16 ones and nf4 values packed two per byte
    scales = quantized * (NF4_BYTES - 0.5)
    layer_bytes = layer_params * (w if plan.finetune.method == "lora" else NF4_BYTES)
    buffers: dict[str, int] = {}
    if plan.backend == "fsdp":
        shard = plan.dp_shard
        weights, gradients = (packed + adapters * FP32) / shard + scales, adapters * FP32 / shard
        optimizer = adapters * OPTIMIZER_BYTES[plan.optimizer][1] / shard
        groups = fsdp_groups(count_params(spec), params.total, layer_params, plan.tp)
        gathered = (layer_bytes * GATHERED_LAYERS + groups.kept * w) if plan.reshard_after_forward else packed
        largest_adapter = max(counts.adapter_layers, default=0)
        buffers = {"fsdp_gathered_params": int(gathered), "fsdp_reduce_scatter": int(largest_adapter * (w + FP32))}
        host = 0
        if plan.offload_params == "cpu":
            host, weights, gradients, optimizer = int(weights + gradients + optimizer), 0, 0, 0
        return int(weights), int(gradients), int(optimizer), buffers, host
    dp = plan.dp if plan.zero >= 1 else 1
    opt_bytes = OPTIMIZER_BYTES[plan.optimizer][0 if plan.precision != "fp32" else 1]
    weights = packed + adapters * w + scales
    gradients = adapters * (FP32 if plan.zero == 0 and plan.precision == "bf16" else w) / dp
    optimizer = opt_bytes * adapters / dp
    host = 0
    if plan.zero in (1, 2):
        buffers["reduce_buckets"] = DS_REDUCE_BUCKET_ELEMENTS * w * (2 if DS_OVERLAP_COMM else 1)
        buffers["allgather_bucket"] = min(DS_ALLGATHER_BUCKET_ELEMENTS, adapters) * w
    if plan.zero == 3:
        # a 4-bit weight is a bf16 tensor of a quarter of its elements (two nf4 values per byte, two bytes each)
        stored = 0.25 if plan.finetune.method == "qlora" else 1
        persistent = sum(n * stored for n in counts.linear_sizes if n * stored <= DS_STAGE3_PERSISTENCE_THRESHOLD)
        persistent_adapters = sum(n for n in counts.adapter_sizes if n <= DS_STAGE3_PERSISTENCE_THRESHOLD)
        # ZeRO-3 casts nothing it did not build under zero.Init: PEFT's adapters on a bf16 base stay in the fp32 it
        # upcasts them to (autocast_adapter_dtype); on a 4-bit base they stay in the compute dtype (measured)
        a = FP32 if plan.finetune.method == "lora" else w
        weights = (packed + adapters * a) / plan.dp + persistent * w + persistent_adapters * a + scales
        buffers["stage3_live_params"] = int(min(DS_STAGE3_MAX_LIVE_PARAMETERS * w, 2 * layer_bytes))
        buffers["stage3_prefetch_bucket"] = min(DS_STAGE3_PREFETCH_ELEMENTS, params.total) * w
        buffers["reduce_bucket"] = DS_REDUCE_BUCKET_ELEMENTS * w
        if plan.offload_params != "none":
            host += weights if plan.offload_params == "cpu" else 0
            weights = scales
    if plan.offload_optimizer != "none":
        if plan.offload_optimizer == "cpu":
            host += optimizer + adapters / dp * FP32
        optimizer = 0
    return int(weights), int(gradients), int(optimizer), {k: int(v) for k, v in buffers.items()}, int(host)


def _step_fp32_grads(spec: ModelSpec, plan: Plan, params: StageParams) -> int:
    """fp32 gradient partition DeepSpeed ZeRO 1/2 builds inside optimizer.step() from the 16-bit one.

    DeepSpeed's own estimator counts it permanently (its "4_grads_32bit"); it lives only while activations are
    freed, so the model compares it with the activation peak instead of adding both.
    """
    if plan.backend != "deepspeed" or plan.zero not in (1, 2) or plan.precision == "fp32":
        return 0
    if plan.offload_optimizer != "none":
        return 0
    if plan.finetune.peft:  # only the adapters have gradients
        return int(FP32 * finetune_counts(spec, plan.finetune).adapters / plan.dp)
    return int(FP32 * (params.dense / plan.dp + params.expert / max(plan.expert_dp, 1)))


def estimate_stage_memory(spec: ModelSpec, plan: Plan, stage: int, counts: ParamCounts | None = None) -> MemoryBreakdown:
    counts = counts or count_params(spec)
    params = stage_params(spec, counts, plan, stage)
    layers = stage_layers(spec.num_layers, plan, stage)
    largest_layer = max((counts.layers[i].total for i in layers), default=0) // plan.tp
    weights, gradients, optimizer, buffers, host = _model_states(spec, plan, params, largest_layer)
    setup = activation_setup(spec, plan)
    last = stage == plan.pp - 1
    alive, embedding_forwards = alive_forwards(spec, plan, stage)
    activations = stage_activation_bytes(spec, setup, alive, embedding_forwards, last_stage=last,
                                         recomputed=recomputed_layers(spec, plan, stage))
    if plan.finetune.peft and plan.recompute != "full":  # what the adapters' matmuls keep, per alive layer
        activations += int(setup.tokens * sum(adapter_activation_bytes(spec, plan.finetune, i, setup.act_bytes)
                                              for i in alive))
    detail = dict(cuda_context=CUDA_CONTEXT_BYTES, **buffers)
    if last:  # gradient of the fp32 logits exists next to the saved ones during the head's backward
        detail["logits_grad"] = FP32 * spec.vocab_size * setup.tokens // plan.tp
    step_grads = _step_fp32_grads(spec, plan, params)
    if step_grads > activations:  # inside step() activations are freed: only the larger of the two peaks counts
        detail["step_fp32_grads"] = step_grads - activations
    detail["allocator_margin"] = int(ALLOCATOR_MARGIN * (weights + gradients + optimizer + activations))
    return MemoryBreakdown(
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=activations,
        overhead=sum(detail.values()),
        overhead_detail=detail,
        host_bytes=host,
        stage=stage,
        params_on_gpu=params.total,
    )


def representative_stages(spec: ModelSpec, plan: Plan) -> list[int]:
    """The first and last stage, and each middle rank whose chunks hold layers unlike an earlier middle rank's.

    A later rank with the same layers in the same chunks does the same work and keeps a prefix of the same forwards
    alive (peak_forwards), so it is never slower nor fuller: the search need not look at it.
    """
    return _representative_stages(spec, PipelineSplit.of(spec.num_layers, plan))


@lru_cache(maxsize=4096)
def _representative_stages(spec: ModelSpec, split: PipelineSplit) -> list[int]:
    layer_kinds = count_params(spec).layers
    seen, stages = set(), []
    for stage, chunks in enumerate(split.chunks()):
        kind = tuple(tuple(layer_kinds[i] for i in chunk) for chunk in chunks)
        if stage in (0, split.pp - 1) or kind not in seen:
            seen.add(kind)
            stages.append(stage)
    return stages


def estimate_memory(spec: ModelSpec, plan: Plan) -> MemoryBreakdown:
    """The most loaded pipeline stage's per-GPU breakdown (the one that decides whether the plan fits)."""
    counts = count_params(spec)
    stages = (estimate_stage_memory(spec, plan, s, counts) for s in representative_stages(spec, plan))
    return max(stages, key=lambda m: m.total)
