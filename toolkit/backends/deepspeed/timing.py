"""DeepSpeed's step-time terms: ZeRO's gradient reduction and parameter gathers, its own work around the optimizer
(buckets, flattening, fp32 casts) and ZeRO-Offload's transfers and CPU Adam; it trains the HF modules."""

from __future__ import annotations

from toolkit.estimate.comm import Network, collective_time
from toolkit.estimate.efficiency import HF, ExecutionPath
from toolkit.estimate.timing import (
    CPU_ADAM_PARAMS_PER_S_PER_NODE,
    exposed_after_backward,
    hbm_bytes_per_s,
    optimizer_step_s,
)
from toolkit.spec.cluster import GPU
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import PRECISION_BYTES, Plan

# ZeRO-3's gathers overlap with compute through prefetch up to this share of a micro-batch's compute.
ZERO3_OVERLAP = 0.7
# DeepSpeed ZeRO-1/2's own work around the optimizer (deepspeed/runtime/zero/stage_1_and_2.py, 0.19): every
# micro-batch each rank copies its bf16 gradients into the reduction buckets (read 2 + write 2 B/param); every step,
# over its partition, it flattens them (2 + 2), casts them to fp32 (2 + 4), takes their norm (2) and unscales and
# clips them in place (4 + 4) before Adam runs.
DEEPSPEED_BUCKET_BYTES = 4
DEEPSPEED_STEP_BYTES = 20


def execution_path(plan: Plan) -> ExecutionPath:
    """The HF modules, under DeepSpeed's engine."""
    return HF


def data_parallel_and_optimizer(spec: ModelSpec, plan: Plan, gpu: GPU, network: Network, compute_micro: float,
                                params_total: int, trainable: int) -> tuple[float, float, float]:
    """(exposed ZeRO communication, optimizer step, offload transfers) per step, in seconds."""
    a = PRECISION_BYTES[plan.precision]
    dp_group = plan.data_ranks
    link = network.link(dp_group, plan.tp)  # tp is innermost
    m = plan.grad_accum
    grads = trainable * a
    if plan.zero <= 1:
        exposed = exposed_after_backward(collective_time("all_reduce", grads, dp_group, link), compute_micro)
    elif plan.zero == 2:  # reduce-scatter every micro-batch, all-gather of updated params after the step
        exposed = m * exposed_after_backward(collective_time("reduce_scatter", grads, dp_group, link), compute_micro)
        exposed += collective_time("all_gather", grads, dp_group, link)
    else:  # ZeRO-3: gather every parameter for forward and backward, reduce-scatter the gradients, every micro-batch
        per_micro = 2 * collective_time("all_gather", params_total * a, dp_group, link)
        per_micro += collective_time("reduce_scatter", grads, dp_group, link)
        exposed = m * max(0.0, per_micro - ZERO3_OVERLAP * compute_micro)
    partition = trainable / (dp_group if plan.zero >= 1 else 1)
    optimizer_s = optimizer_step_s(partition, gpu)
    if plan.zero <= 2:  # gradient buckets hold the trainable parameters' gradients
        optimizer_s += (partition * DEEPSPEED_STEP_BYTES + m * trainable * DEEPSPEED_BUCKET_BYTES) / hbm_bytes_per_s(gpu)
    offload_s = 0.0
    if plan.offload_optimizer != "none":
        pcie = gpu.pcie_bw_gbps * 1e9
        offload_s = partition * (4 + a) / pcie  # fp32 grads down, 16-bit params up
        offload_s += partition * plan.gpus_per_node / CPU_ADAM_PARAMS_PER_S_PER_NODE
        optimizer_s = 0.0
    if plan.offload_params != "none":
        offload_s += 2 * m * params_total * a / plan.data_ranks / (gpu.pcie_bw_gbps * 1e9)
    return exposed, optimizer_s, offload_s
