"""DeepSpeed's memory terms: its ZeRO model states and buffers, and the fp32 gradients its ZeRO-1/2 step builds.

- ZeRO stages partition optimizer states (1), + gradients (2), + parameters (3) over data parallel ranks; mixed
  precision Adam keeps K = 12 bytes/param of fp32 master weights and moments (Rajbhandari et al., "ZeRO",
  arXiv:1910.02054, Sec. 3-5: (2 + 2 + K) x Psi / Nd).
- DeepSpeed bucket defaults: reduce_bucket_size and allgather_bucket_size 5e8 elements, stage3 prefetch bucket
  5e7, max live parameters 1e9 (deepspeed/runtime/zero/config.py); the generated deepspeed.json writes the same.
"""

from __future__ import annotations

from toolkit.estimate.lora import finetune_counts
from toolkit.estimate.memory import FP32, ModelStates, StageParams, frozen_base, optimizer_bytes
from toolkit.spec.engine_settings import (  # the buckets the generated deepspeed.json sets
    DS_ALLGATHER_BUCKET_ELEMENTS,
    DS_OVERLAP_COMM,
    DS_REDUCE_BUCKET_ELEMENTS,
    DS_STAGE3_MAX_LIVE_PARAMETERS,
    DS_STAGE3_PREFETCH_ELEMENTS,
)
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import PRECISION_BYTES, Plan

# ZeRO-3 keeps a parameter of at most this many elements gathered on every rank, next to its partition
# (stage3_param_persistence_threshold, deepspeed/runtime/zero/config.py): LoRA's A and B matrices mostly are
DS_STAGE3_PERSISTENCE_THRESHOLD = 100_000


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The HF model's embedding as it is: DeepSpeed pads nothing."""
    return vocab_size


def _zero12_buckets(w: int, trained: int) -> dict[str, int]:
    """ZeRO-1/2's reduce buckets (double-buffered with overlap_comm) and the all-gather bucket of the trained params."""
    return {"reduce_buckets": DS_REDUCE_BUCKET_ELEMENTS * w * (2 if DS_OVERLAP_COMM else 1),
            "allgather_bucket": min(DS_ALLGATHER_BUCKET_ELEMENTS, trained) * w}


def saved_bytes_per_param(plan: Plan) -> int:
    """Bytes per trained parameter one checkpoint holds: the 16-bit module (mp_rank_*_model_states.pt) and the fp32
    master weights with the optimizer's moments (zero_pp_rank_*_optim_states.pt)."""
    return PRECISION_BYTES[plan.precision] + optimizer_bytes(plan.optimizer, plan.precision != "fp32")


def model_states(spec: ModelSpec, plan: Plan, params: StageParams, layer_params: int) -> ModelStates:
    """(weights, gradients, optimizer, comm buffers, host bytes) on one GPU under ZeRO-`plan.zero`."""
    if plan.finetune.peft:
        return _frozen_base_states(spec, plan, params, layer_params)
    w = PRECISION_BYTES[plan.precision]
    opt_bytes = optimizer_bytes(plan.optimizer, plan.precision != "fp32")
    dense, expert = params.dense, params.expert
    buffers: dict[str, int] = {}
    host = 0
    dp = plan.data_ranks
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
        buffers.update(_zero12_buckets(w, params.total))
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


def _frozen_base_states(spec: ModelSpec, plan: Plan, params: StageParams, layer_params: int) -> ModelStates:
    """LoRA adapters on a frozen base (toolkit/estimate/memory.py FrozenBase): DeepSpeed casts the whole module,
    adapters included, to the training dtype; the base is sharded only under ZeRO-3."""
    w = PRECISION_BYTES[plan.precision]
    base = frozen_base(spec, plan, params, layer_params)
    counts, packed, scales = base.counts, base.packed, base.scales
    adapters = counts.adapters
    buffers: dict[str, int] = {}
    dp = plan.data_ranks if plan.zero >= 1 else 1
    opt_bytes = optimizer_bytes(plan.optimizer, plan.precision != "fp32")
    weights = packed + adapters * w + scales
    gradients = adapters * (FP32 if plan.zero == 0 and plan.precision == "bf16" else w) / dp
    optimizer = opt_bytes * adapters / dp
    host = 0
    if plan.zero in (1, 2):
        buffers.update(_zero12_buckets(w, adapters))
    if plan.zero == 3:
        # a 4-bit weight is a bf16 tensor of a quarter of its elements (two nf4 values per byte, two bytes each)
        stored = 0.25 if plan.finetune.method == "qlora" else 1
        persistent = sum(n * stored for n in counts.linear_sizes if n * stored <= DS_STAGE3_PERSISTENCE_THRESHOLD)
        persistent_adapters = sum(n for n in counts.adapter_sizes if n <= DS_STAGE3_PERSISTENCE_THRESHOLD)
        # ZeRO-3 casts nothing it did not build under zero.Init: PEFT's adapters on a bf16 base stay in the fp32 it
        # upcasts them to (autocast_adapter_dtype); on a 4-bit base they stay in the compute dtype (measured)
        a = FP32 if plan.finetune.method == "lora" else w
        weights = (packed + adapters * a) / plan.data_ranks + persistent * w + persistent_adapters * a + scales
        buffers["stage3_live_params"] = int(min(DS_STAGE3_MAX_LIVE_PARAMETERS * w, 2 * base.layer_bytes))
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


def step_fp32_grads(spec: ModelSpec, plan: Plan, params: StageParams) -> int:
    """fp32 gradient partition DeepSpeed ZeRO 1/2 builds inside optimizer.step() from the 16-bit one.

    DeepSpeed's own estimator counts it permanently (its "4_grads_32bit"); it lives only while activations are
    freed, so the model compares it with the activation peak instead of adding both.
    """
    if plan.zero not in (1, 2) or plan.precision == "fp32":
        return 0
    if plan.offload_optimizer != "none":
        return 0
    if plan.finetune.peft:  # only the adapters have gradients
        return int(FP32 * finetune_counts(spec, plan.finetune).adapters / plan.data_ranks)
    return int(FP32 * (params.dense / plan.data_ranks + params.expert / max(plan.expert_dp, 1)))


def alive_at_backward_start(plan: Plan, gradients: int, buffers: dict[str, int]) -> int:
    """Bytes of model_states' gradients and buffers that exist when a micro-batch's backward starts, before any
    parameter's gradient (the loss's backward): ZeRO-1/2 allocate their reduce buckets and gradient partition at the
    first gradient hook (stage_1_and_2.py `setup_buckets`, from `process_gradients`) and free them after the step
    (`_release_ipg_buffers`); ZeRO-0's bf16 optimizer and ZeRO-3 keep their gradient buffers and (ZeRO-3) their
    buckets from initialisation on. Gradients accumulated over earlier micro-batches of the step exist on every
    stage."""
    kept_gradients = plan.grad_accum > 1 or plan.zero == 3 or (plan.zero == 0 and plan.precision == "bf16")
    return (gradients if kept_gradients else 0) + (sum(buffers.values()) if plan.zero == 3 else 0)
