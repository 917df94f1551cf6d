"""Per-GPU training memory (weights, gradients, optimizer, activations, overhead) of a model under a plan.

Pure arithmetic: no process group, no GPU. What every plan shares lives here: the parameters each pipeline stage
holds, the activations alive at its peak (activations.py), the optimizer's bytes per parameter, the transient
tensors (under HF Trainer the last stage's loss has a peak of its own, before the layers' backward: head_backward_bytes)
and the overhead outside the tensors. Each backend's own model states (what it shards, the buffers it keeps, which of
them exist when backward starts), its vocabulary padding and what exists only inside its optimizer step are its
memory part, toolkit/backends/<name>/memory.py, reached through `backend_of(plan).memory`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache

from toolkit.estimate.activations import (
    ActivationSetup,
    fp32_logits_bytes_per_token,
    offloaded_activation_bytes,
    recompute_working_bytes,
    routed_token_factor,
    stage_activation_bytes,
)
from toolkit.estimate.long_context import sequence_working_bytes
from toolkit.estimate.lora import NF4_BYTES, FinetuneCounts, adapter_activation_bytes, finetune_counts
from toolkit.estimate.params import LayerParams, ParamCounts, count_params
from toolkit.estimate.pipeline import peak_forwards
from toolkit.numeric import GiB
from toolkit.spec.backends import backend_of
from toolkit.spec.cluster import GPU
from toolkit.spec.model import ModelSpec, by_identity, per_model
from toolkit.spec.options import RECOMPUTE_KEYS
from toolkit.spec.pipeline import PipelineSplit
from toolkit.spec.plan import PRECISION_BYTES, Plan
from toolkit.spec.quantization import plan_recipe

FP32 = 4

# Outside what PyTorch's allocator reports: CUDA context, cuBLAS/cuDNN workspaces, NCCL channel buffers.
# Typical on H100 with CUDA 12: 500-700 MiB per process; we budget 0.75 GiB.
CUDA_CONTEXT_BYTES = int(0.75 * GiB)
# Caching-allocator fragmentation: reserved exceeds allocated by a few percent in steady training.
ALLOCATOR_MARGIN = 0.05

# Optimizer bytes per parameter: (with low-precision weights: fp32 master + states, with fp32 weights: states only)
OPTIMIZER_BYTES = {"adamw": (12, 8), "sgd": (8, 4), "adamw8bit": (6, 2)}

# (weights, gradients, optimizer, comm buffers by name, host bytes) on one GPU: a backend's model states
ModelStates = tuple[int, int, int, dict, int]


def optimizer_bytes(optimizer: str, master_copy: bool) -> int:
    """Optimizer bytes per trained parameter: with an fp32 master copy of low-precision weights, or states only."""
    return OPTIMIZER_BYTES[optimizer][0 if master_copy else 1]


@dataclass(frozen=True)
class StageParams:
    """Parameters resident on one rank of a pipeline stage, before any ZeRO / distributed-optimizer sharding."""

    dense: int  # replicated across data parallel ranks
    expert: int  # replicated across expert-data-parallel ranks only
    gemm: int = 0  # of both, the linear layers' weights (attention, MLP, experts): what fp8 / fp4 recipes quantize

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


def layer_params(counts: ParamCounts, plan: Plan, index: int) -> tuple[int, int]:
    """(dense, expert) parameters of layer `index` on one rank of its tensor- and expert-parallel groups."""
    return layer_shard(counts.layers[index], plan.tp, plan.ep * plan.expert_tp)


def layer_shard(layer: LayerParams, tp: int, expert_split: int) -> tuple[int, int]:
    """(dense, expert) parameters of one block on one rank: its attention and dense MLP over TP, its experts over
    EP x ETP (`expert_split`)."""
    return (layer.attention_sharded + layer.mlp_sharded) // tp + layer.replicated + layer.router, (
        layer.experts // expert_split)


def stage_params(spec: ModelSpec, counts: ParamCounts, plan: Plan, stage: int) -> StageParams:
    tp = plan.tp
    expert_split = plan.ep * plan.expert_tp
    dense = expert = gemm = 0
    split = PipelineSplit.of(spec.num_layers, plan)
    for layer, n in counts.kinds_of(split, stage):  # integers: in any order, the same sums
        layer_dense, layer_expert = layer_shard(layer, tp, expert_split)
        dense += n * layer_dense
        expert += n * layer_expert
        gemm += n * ((layer.attention_sharded + layer.mlp_sharded) // tp + layer_expert)
    emb_dim = counts.token_embedding // spec.vocab_size
    vocab = backend_of(plan).memory.padded_vocab(spec.vocab_size, tp)
    vocab_shard = vocab * emb_dim // tp
    first, last = stage == 0, stage == plan.pp - 1
    if first:
        dense += vocab_shard + counts.position_embedding + counts.embed_proj
    if last:
        dense += counts.final_norm
        if trains_mtp(spec, plan):
            # Megatron-Core builds the multi-token prediction modules after the last stage's layers (transformers
            # builds none): each a block like the last layer, its norms and eh_proj (column parallel)
            for layer in counts.mtp_layers:
                layer_dense, layer_expert = layer_shard(layer, tp, expert_split)
                dense += layer_dense
                expert += layer_expert
            dense += counts.mtp_eh_proj // tp + counts.mtp_norms
        if counts.lm_head:
            dense += vocab_shard
        elif plan.pp > 1:  # tied head on another stage keeps its own copy of the embedding
            dense += vocab_shard
    return StageParams(dense=dense, expert=expert, gemm=gemm)


def alive_forwards(spec: ModelSpec, plan: Plan, stage: int) -> tuple[tuple[int, ...], int]:
    """(layers once per forward alive at the rank's peak, forwards through the embedding) under Megatron's schedule.

    DeepSpeed's pipeline engine runs the same 1F1B order as Megatron's non-interleaved schedule.
    """
    return _alive_forwards(PipelineSplit.of(spec.num_layers, plan), stage, plan.grad_accum)


@lru_cache(maxsize=4096)
def _alive_forwards(split: PipelineSplit, stage: int, micro_batches: int) -> tuple[tuple[int, ...], int]:
    chunks = split.chunks()[stage]
    forwards = peak_forwards(split.pp, split.vpp, stage, micro_batches)
    alive = tuple(layer for chunk in forwards for layer in chunks[chunk])
    return alive, forwards.count(0) if stage == 0 else 0


def recomputed_layers(spec: ModelSpec, plan: Plan, stage: int) -> frozenset[int] | None:
    """Layers of a rank whose activations full recompute drops: the first recompute_num_layers of every model chunk
    (Megatron-Core's block method, TransformerBlock._checkpointed_forward); None: every layer (or no full recompute)."""
    if plan.recompute != "full" or plan.recompute_num_layers is None:
        return None
    return _first_layers_of_chunks(PipelineSplit.of(spec.num_layers, plan), stage, plan.recompute_num_layers)


@lru_cache(maxsize=4096)
def _first_layers_of_chunks(split: PipelineSplit, stage: int, layers: int) -> frozenset[int]:
    return frozenset(layer for chunk in split.chunks()[stage] for layer in chunk[:layers])


@by_identity(2)
def activation_setup(spec: ModelSpec, plan: Plan) -> ActivationSetup:
    # one object per distinct setup, built once: the per-layer memos keyed by it (activations.py) match it by
    # identity, not field by field
    values = _activation_setup(spec, plan)
    key = tuple(values.values())  # the fields in one order: equal keys, equal setups
    setup = _SETUPS.get(key)
    if setup is None:
        if len(_SETUPS) >= SETUP_ENTRIES:
            _SETUPS.clear()
        setup = _SETUPS[key] = ActivationSetup(**values)
    return setup


_SETUPS: dict[tuple, ActivationSetup] = {}
SETUP_ENTRIES = 8192


def _activation_setup(spec: ModelSpec, plan: Plan) -> dict:
    """ActivationSetup's fields for the plan."""
    return dict(
        hf_modules=backend_of(plan).hf_modules,
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
        sp=plan.sp,
        tiled_mlp=plan.tiled_mlp,
        tiled_loss=plan.tiled_loss,
        offload_activations=plan.offload_activations != "none",
        ep=plan.ep,
        expert_tp=plan.expert_tp,
        routed_factor=routed_token_factor(plan.ep, plan.moe_imbalance) if spec.is_moe else 1.0,
        hf_activation=spec.hf_activation,
        hidden_dropout=spec.hidden_dropout,
        attention_dropout=spec.attention_dropout,
        gemm_input_bytes=saved_gemm_input_bytes(plan),
    )


def saved_gemm_input_bytes(plan: Plan) -> float:
    """Bytes per element Transformer Engine's GEMMs save of their inputs under the plan's fp8 / fp4 recipe (0: they
    save the 16-bit input itself); Megatron-Core's TE layers only (under HF Trainer no recipe runs)."""
    recipe = plan_recipe(plan)
    return recipe.saved_input_bytes if recipe is not None and not backend_of(plan).hf_modules else 0.0


@dataclass(frozen=True)
class FrozenBase:
    """A frozen base with LoRA adapters on it, before any sharding (what every backend's frozen-base states start from).

    The base keeps its stored precision (bf16, or nf4 with its block scales for qlora); gradients, optimizer states
    and fp32 masters exist for the adapters only. bitsandbytes' block scales are buffers of the quantisation state,
    not parameters: no sharding divides them.
    """

    counts: FinetuneCounts
    packed: float  # parameters: bf16 ones and nf4 values packed two per byte
    scales: float  # nf4 block scales
    layer_bytes: float  # the largest layer as stored


def frozen_base(spec: ModelSpec, plan: Plan, params: StageParams, layer_params: int) -> FrozenBase:
    w = PRECISION_BYTES[plan.precision]
    counts = finetune_counts(spec, plan.finetune)
    base = params.total  # the backends that fine-tune adapters hold the whole model per stage (pp = tp = 1)
    quantized = counts.quantized
    return FrozenBase(counts=counts, packed=(base - quantized) * w + quantized * 0.5,
                      scales=quantized * (NF4_BYTES - 0.5),
                      layer_bytes=layer_params * (w if plan.finetune.method == "lora" else NF4_BYTES))


# Plan fields no model-state term reads (the stage's parameters, a backend's model_states): the batch and how
# activations are kept, which the plan search varies within one layout. Plans equal in every other field share
# stage_model_states' answer (tests/unit/test_search_equivalence.py estimates each ranked plan afresh).
MODEL_STATE_BLIND = frozenset({"micro_batch", "global_batch", "grad_accum", *RECOMPUTE_KEYS})


class _ModelStatesKey:
    """A plan as stage_model_states' memo sees it: equal to every plan that differs from it only in
    MODEL_STATE_BLIND fields."""

    __slots__ = ("plan", "fields", "hash")

    def __init__(self, plan: Plan):
        self.plan = plan
        self.fields = _STATE_FIELDS(plan.__dict__)
        self.hash = hash(self.fields)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ModelStatesKey) and self.fields == other.fields


_STATE_FIELDS = operator.itemgetter(*(name for name in Plan.model_fields if name not in MODEL_STATE_BLIND))
_model_states_key = by_identity(1)(_ModelStatesKey)  # once per plan, not per stage


@by_identity(2)
def stage_model_states(spec: ModelSpec, plan: Plan, stage: int) -> tuple[StageParams, ModelStates]:
    """(parameters, model states) of one rank of pipeline stage `stage`: the backend's weights, gradients, optimizer
    states, buffers and host bytes over the stage's parameters (its memory part's model_states). Remembered per
    plan, and across plans that differ only in MODEL_STATE_BLIND fields: the search's memory_floor and
    estimate_memory, and step_time, ask for the same of every micro-batch and recomputation of a layout."""
    return _layout_model_states(spec, _model_states_key(plan), stage)


@per_model
def _layout_model_states(spec: ModelSpec, key: _ModelStatesKey, stage: int) -> tuple[StageParams, ModelStates]:
    plan = key.plan
    counts = count_params(spec)
    params = stage_params(spec, counts, plan, stage)
    kinds = counts.kinds_of(PipelineSplit.of(spec.num_layers, plan), stage)
    largest_layer = max((layer.total for layer, _ in kinds), default=0) // plan.tp
    return params, backend_of(plan).memory.model_states(spec, plan, params, largest_layer)


def memory_floor(spec: ModelSpec, plan: Plan, enough: int | None = None) -> int:
    """A lower bound of estimate_memory(spec, plan).total that skips the activations: the largest weights, gradients
    and optimizer states of a representative stage, and the CUDA context. Every other term of a stage's total
    (activations, buffers, working tensors, the allocator's margin, the loss's peak) is a count of bytes, never
    negative, and the plan's total is its fullest stage's. With `enough`, the stages stop at the first whose bound
    exceeds it (still a lower bound). The plan search refuses what this alone does not fit without estimating the
    rest (tests/unit/test_search_equivalence.py checks the bound). Remembered like stage_model_states."""
    return _layout_floor(spec, _model_states_key(plan), enough)


@per_model
def _layout_floor(spec: ModelSpec, key: _ModelStatesKey, enough: int | None) -> int:
    plan = key.plan
    floor = 0
    for stage in representative_stages(spec, plan):
        floor = max(floor, sum(stage_model_states(spec, plan, stage)[1][:3]) + CUDA_CONTEXT_BYTES)
        if enough is not None and floor > enough:
            break
    return floor


def estimate_stage_memory(spec: ModelSpec, plan: Plan, stage: int) -> MemoryBreakdown:
    params, (weights, gradients, optimizer, buffers, host) = stage_model_states(spec, plan, stage)
    memory = backend_of(plan).memory
    setup = activation_setup(spec, plan)
    last = stage == plan.pp - 1
    alive, embedding_forwards = alive_forwards(spec, plan, stage)
    recomputed = recomputed_layers(spec, plan, stage)
    activations = stage_activation_bytes(spec, setup, alive, embedding_forwards, last_stage=last, recomputed=recomputed)
    host += offloaded_activation_bytes(spec, setup, alive, recomputed)
    if plan.finetune.peft and plan.recompute != "full":  # what the adapters' matmuls keep, per alive layer
        activations += int(setup.tokens * sum(adapter_activation_bytes(spec, plan.finetune, i, setup.act_bytes)
                                              for i in alive))
    detail = dict(cuda_context=CUDA_CONTEXT_BYTES, **buffers)
    working = sequence_working_bytes(spec, setup, last)
    loss_tile = working.pop("tiled_loss_tile", 0) if setup.hf_modules else 0  # the head's peak (below)
    detail.update(working)
    step_grads = memory.step_fp32_grads(spec, plan, params)
    if step_grads > activations:  # inside step() activations are freed: only the larger of the two peaks counts
        detail["step_fp32_grads"] = step_grads - activations
    detail["allocator_margin"] = int(ALLOCATOR_MARGIN * (weights + gradients + optimizer + activations))
    if last:  # the stage's two peaks: the loss's (here) and the layers' backward (the sum above)
        head = head_backward_bytes(spec, setup, alive, recomputed, activations, loss_tile)
        before = weights + optimizer + memory.alive_at_backward_start(plan, gradients, buffers)
        rest = weights + gradients + optimizer + activations + sum(detail.values())
        if before + head + detail["cuda_context"] + detail["allocator_margin"] > rest:
            detail["head_backward"] = before + head + detail["cuda_context"] + detail["allocator_margin"] - rest
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


def head_backward_bytes(spec: ModelSpec, setup: ActivationSetup, alive, recomputed, activations: int,
                        loss_tile: int) -> int:
    """Activation bytes at the loss's peak: the activations the layers keep (the loss's saved fp32 output among
    them) and what the loss adds to them (benchmarks/loss_memory_cpu.md):
    - HF, untiled: its log-softmax's backward, three fp32 logits alive (the log-softmax output kept for backward, the
      gradient arriving at it from the NLL's backward, the gradient it returns): two beyond the kept one.
    - HF, tiled: one tile's forward and backward, run inside forward (`loss_tile`, sequence_working_bytes).
    - Megatron-Core (tensor_parallel.vocab_parallel_cross_entropy, an autograd Function): its fp32 copy of the 16-bit
      logits becomes the softmax in place and is kept; backward turns it into the gradient in place, which autograd
      casts to the logits' dtype: the kept fp32 logits and a 16-bit copy, in backward as in forward (the 16-bit
      logits beside the fp32 copy).
    Each comes before the layers' backward, so neither the block full recompute runs again nor the layers'
    transients exist yet; the stage's other peak, the layers' backward, is what the rest of the estimate sums: by
    then the loss's tensors are freed, and only the kept output, which the activations count, is left in that sum
    (an over-count of one fp32 logits where that peak is the larger)."""
    kept = activations - recompute_working_bytes(spec, setup, alive, recomputed)
    if not setup.hf_modules:  # (in fp32, .float() returns the logits themselves and no cast follows)
        return kept + (_fp32_logits(spec, setup) * setup.act_bytes // FP32 if setup.act_bytes < FP32 else 0)
    return kept + (loss_tile if setup.tiled_loss else 2 * _fp32_logits(spec, setup))


def loss_peak_bytes(spec: ModelSpec, plan: Plan) -> int:
    """head_backward_bytes of the plan's last stage: its activation bytes at the loss's peak."""
    stage = plan.pp - 1
    setup = activation_setup(spec, plan)
    alive, _ = alive_forwards(spec, plan, stage)
    return head_backward_bytes(spec, setup, alive, recomputed_layers(spec, plan, stage),
                               estimate_stage_memory(spec, plan, stage).activations,
                               sequence_working_bytes(spec, setup, True).get("tiled_loss_tile", 0))


def _fp32_logits(spec: ModelSpec, setup: ActivationSetup) -> int:
    return int(fp32_logits_bytes_per_token(spec, setup) * setup.tokens)


def exceeded(memory: MemoryBreakdown, gpu: GPU, gpus_per_node: int) -> tuple[str, int] | None:
    """What does not fit, as (component, bytes needed): the GPU's memory (`gpu`), or the host's RAM that offload
    needs on a node (`host`) when the cluster states it (GPU.host_memory_bytes); None when it all fits."""
    if memory.total > gpu.memory_bytes:
        return "gpu", memory.total
    host = memory.host_bytes * gpus_per_node
    if gpu.host_memory_bytes is not None and host > gpu.host_memory_bytes:
        return "host", host
    return None


def representative_stages(spec: ModelSpec, plan: Plan) -> list[int]:
    """The first and last stage, and each middle rank whose chunks hold layers unlike an earlier middle rank's.

    A later rank with the same layers in the same chunks does the same work and keeps a prefix of the same forwards
    alive (peak_forwards), so it is never slower nor fuller: the search need not look at it.
    """
    return _representative_stages(spec, PipelineSplit.of(spec.num_layers, plan))


@per_model
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
    return _fullest(estimate_stage_memory(spec, plan, s) for s in representative_stages(spec, plan))


def fitting_memory(spec: ModelSpec, plan: Plan, gpu: GPU) -> MemoryBreakdown | None:
    """estimate_memory(spec, plan) when the plan fits `gpu` (`exceeded` finds nothing), else None. The plan's total
    is its fullest stage's, so the stages stop at the first whose total alone is over the GPU's memory (exceeded's
    first test): the plan search asks this of every candidate, and most of those it estimates do not fit."""
    stages = []
    for stage in representative_stages(spec, plan):
        memory = estimate_stage_memory(spec, plan, stage)
        if memory.total > gpu.memory_bytes:
            return None
        stages.append(memory)
    memory = _fullest(stages)
    return memory if exceeded(memory, gpu, plan.gpus_per_node) is None else None


def _fullest(stages: Iterable[MemoryBreakdown]) -> MemoryBreakdown:
    """The stage with the largest total (the first of equals, in representative_stages' order)."""
    return max(stages, key=lambda m: m.total)



def trains_mtp(spec: ModelSpec, plan: Plan) -> bool:
    """Whether the plan's backend trains the model's multi-token prediction modules: Megatron-Core builds them on
    the last pipeline stage (--mtp-num-layers); transformers builds none, so the HF backends drop them."""
    return bool(spec.mtp_layers) and not backend_of(plan).hf_modules
