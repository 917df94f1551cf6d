"""FSDP2's memory terms (torch.distributed.fsdp.fully_shard, as Accelerate applies it for the HF Trainer): the bytes
each GPU holds. The communication each step sends is its timing part (timing.py).

What the libraries do, and so what is counted:
- Accelerate (utils/fsdp_utils.py fsdp2_prepare_model) upcasts trainable parameters to fp32 when training in mixed
  precision and calls `fully_shard` on every decoder layer, on the input embedding, on a tail group [final norm,
  output embedding] with reshard_after_forward=False, and on the root (the rest: position embeddings, projections),
  which FSDP2 does not reshard either. The sharded fp32 parameters, their fp32 gradients and the optimizer's states
  (no separate master copy: the fp32 shards are it) are 1/dp_shard of a replica each; HSDP (dp_replicate > 1)
  repeats the shards in every replica.
- The toolkit's MixedPrecisionPolicy gathers parameters in the compute dtype and reduce-scatters gradients in fp32
  (param_dtype=bf16, reduce_dtype=fp32). While a layer computes, its gathered copy and the next one's (prefetched)
  are alive; with reshard_after_forward=False every layer stays gathered from its forward to its backward. The
  gradient of the layer being reduced exists unsharded in the compute dtype and as the fp32 reduce-scatter input.
- Gradient accumulation reduce-scatters every micro-batch: trainer_args.json sets Accelerate's
  `sync_each_batch`, because under Accelerate's `no_sync` FSDP2 would keep the whole replica's unsharded gradient
  in the reduce dtype on every GPU until the last micro-batch (torch _fsdp_param.py to_accumulated_grad_if_needed).
- CPUOffloadPolicy keeps the sharded parameters, gradients and optimizer states in host memory and steps the
  optimizer there; the gathered copies still live on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.estimate.memory import FP32, ModelStates, StageParams, frozen_base, optimizer_bytes
from toolkit.estimate.params import ParamCounts, count_params
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import PRECISION_BYTES, Plan

# gathered layer groups alive at once while resharding: the one computing and the one prefetched (FSDP2's implicit
# forward and backward prefetch of the next group's all-gather)
GATHERED_LAYERS = 2


@dataclass(frozen=True)
class FsdpGroups:
    """Parameters (per TP rank) of the groups Accelerate's fsdp2_prepare_model makes."""

    layer: int  # the largest decoder layer
    kept: int  # the tail [final norm, output embedding] and the root's leftovers: gathered from forward to backward
    total: int


def fsdp_groups(counts: ParamCounts, params_total: int, largest_layer: int, tp: int) -> FsdpGroups:
    tail = counts.final_norm + (counts.lm_head or counts.token_embedding) // tp
    root = counts.position_embedding + counts.embed_proj
    return FsdpGroups(layer=largest_layer, kept=tail + root, total=params_total)


def fsdp_model_states(plan: Plan, groups: FsdpGroups, optimizer_state_bytes: int) -> ModelStates:
    """(weights, gradients, optimizer, buffers, host bytes) on one GPU; `optimizer_state_bytes` per fp32 parameter."""
    shard = groups.total / shard_ranks(plan)
    weights, gradients, optimizer = shard * FP32, shard * FP32, shard * optimizer_state_bytes
    w = PRECISION_BYTES[plan.precision]
    if plan.reshard_after_forward:
        gathered = GATHERED_LAYERS * groups.layer + groups.kept
    else:  # every group stays gathered between its forward and its backward
        gathered = groups.total
    buffers = {"fsdp_gathered_params": int(gathered * w),
               # the layer being reduced: its gradient in the compute dtype and the fp32 reduce-scatter input
               "fsdp_reduce_scatter": int(groups.layer * (w + (FP32 if w != FP32 else 0)))}
    host = 0
    if plan.offload_params == "cpu":
        host = int(weights + gradients + optimizer)
        weights = gradients = optimizer = 0
    return int(weights), int(gradients), int(optimizer), buffers, host


def shard_ranks(plan: Plan) -> int:
    """Ranks each parameter is sharded over: dp_shard, times cp with context parallelism (Accelerate's dp_shard_cp
    mesh dimension, accelerate/parallelism_config.py)."""
    return plan.dp_shard * plan.cp


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The HF model's embedding as it is: FSDP2 pads nothing."""
    return vocab_size


def saved_bytes_per_param(plan: Plan) -> int:
    """Bytes per trained parameter one checkpoint holds: the fp32 shards (their own master copy,
    pytorch_model_fsdp_0/) and the optimizer's states (optimizer_0/)."""
    return FP32 + optimizer_bytes(plan.optimizer, master_copy=False)


def model_states(spec: ModelSpec, plan: Plan, params: StageParams, layer_params: int) -> ModelStates:
    """(weights, gradients, optimizer, comm buffers, host bytes) on one GPU: fp32 shards are their own master copy,
    so the optimizer keeps its states only."""
    if plan.finetune.peft:
        return _frozen_base_states(spec, plan, params, layer_params)
    groups = fsdp_groups(count_params(spec), params.total, layer_params, plan.tp)
    return fsdp_model_states(plan, groups, optimizer_bytes(plan.optimizer, master_copy=False))


def _frozen_base_states(spec: ModelSpec, plan: Plan, params: StageParams, layer_params: int) -> ModelStates:
    """LoRA adapters on a frozen base (toolkit/estimate/memory.py FrozenBase): Accelerate's FSDP2 preparation upcasts
    the trainable adapters to fp32 (their own master copy) and leaves the frozen base as loaded (bf16; a 4-bit base
    as bitsandbytes packed it, in bnb_4bit_quant_storage = the training dtype); the block scales stay whole."""
    w = PRECISION_BYTES[plan.precision]
    base = frozen_base(spec, plan, params, layer_params)
    adapters, packed, scales = base.counts.adapters, base.packed, base.scales
    shard = shard_ranks(plan)
    weights, gradients = (packed + adapters * FP32) / shard + scales, adapters * FP32 / shard
    optimizer = adapters * optimizer_bytes(plan.optimizer, master_copy=False) / shard
    groups = fsdp_groups(count_params(spec), params.total, layer_params, plan.tp)
    gathered = (base.layer_bytes * GATHERED_LAYERS + groups.kept * w) if plan.reshard_after_forward else packed
    largest_adapter = max(base.counts.adapter_layers, default=0)
    buffers = {"fsdp_gathered_params": int(gathered), "fsdp_reduce_scatter": int(largest_adapter * (w + FP32))}
    host = 0
    if plan.offload_params == "cpu":
        host, weights, gradients, optimizer = int(weights + gradients + optimizer), 0, 0, 0
    return int(weights), int(gradients), int(optimizer), buffers, host


def step_fp32_grads(spec: ModelSpec, plan: Plan, params: StageParams) -> int:
    """Nothing: FSDP2's gradient shards are fp32 already, counted by model_states for the whole run."""
    return 0


def alive_at_backward_start(plan: Plan, gradients: int, buffers: dict[str, int]) -> int:
    """Bytes of model_states' gradients and buffers that exist when a micro-batch's backward starts, before any
    parameter's gradient (the loss's backward): the gathered parameters; not the gradient shards (the Trainer's
    zero_grad sets them to None after each step) unless earlier micro-batches of the step accumulated them, nor the
    reduce-scatter of a layer's gradient."""
    return buffers.get("fsdp_gathered_params", 0) + (gradients if plan.grad_accum > 1 else 0)
