"""FSDP2's step-time terms: the all-gathers and reduce-scatters of fully_shard (HSDP's all-reduce across replicas),
its optimizer over the fp32 shard, and CPUOffloadPolicy's copies; it trains the HF modules. What each GPU holds is
its memory part (memory.py)."""

from __future__ import annotations

from toolkit.backends.fsdp.memory import FsdpGroups, fsdp_groups, shard_ranks
from toolkit.estimate.comm import Network, collective_time
from toolkit.estimate.efficiency import HF, ExecutionPath
from toolkit.estimate.memory import FP32
from toolkit.estimate.params import count_params
from toolkit.estimate.timing import CPU_ADAM_PARAMS_PER_S_PER_NODE, optimizer_step_s
from toolkit.spec.cluster import GPU
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import PRECISION_BYTES, Plan

# Share of a micro-batch's compute that FSDP2's prefetching hides communication behind. First fitted on torchtitan's
# Llama 3.1 8B FSDP2 runs on H100s (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3,
# local batch 2 x 8192: 5,762 tokens/s/GPU on one node, 5,605 on 16) when the model sent a ring across nodes through
# one NIC. With rings through every NIC of a node (toolkit/estimate/comm.py) that row's communication is hidden at any
# value above ~0.1 (tests/unit/test_fsdp_estimate.py); the one published FSDP2 row whose communication is a large
# share of its compute, NeMo AutoModel's Llama 3 70B on 64 H100s (~60% of it, benchmarks/step_time_accuracy.md), is
# predicted within 7% at this value. Nothing published yet pins it more tightly.
FSDP2_OVERLAP = 0.55


def execution_path(plan: Plan) -> ExecutionPath:
    """The HF modules, under FSDP2's hooks."""
    return HF


def data_parallel_and_optimizer(spec: ModelSpec, plan: Plan, gpu: GPU, network: Network, compute_micro: float,
                                params_total: int, trainable: int) -> tuple[float, float, float]:
    """(exposed all-gathers and reduce-scatters, optimizer step, offload copies) per step, in seconds: AdamW over the
    fp32 shard, on the GPU or, with CPUOffloadPolicy, by torch's AdamW on the host after the gradients travel down."""
    counts = count_params(spec)
    largest_layer = max(layer.total for layer in counts.layers) // plan.tp
    groups = fsdp_groups(counts, params_total, largest_layer, plan.tp)
    exposed = fsdp_communication(plan, groups, network, compute_micro, trainable / params_total)
    shard = trainable / shard_ranks(plan)
    if plan.offload_params == "cpu":
        optimizer_s = shard * plan.gpus_per_node / CPU_ADAM_PARAMS_PER_S_PER_NODE
        return exposed, optimizer_s, fsdp_offload_time(plan, groups, gpu.pcie_bw_gbps * 1e9)
    return exposed, optimizer_step_s(shard, gpu), 0.0


def fsdp_communication(plan: Plan, groups: FsdpGroups, network: Network, compute_micro: float,
                       trained_share: float = 1.0) -> float:
    """Exposed FSDP2 communication of one step, in seconds: every micro-batch all-gathers each group in forward (again
    in backward when resharded), reduce-scatters fp32 gradients in the shard group and, with HSDP, all-reduces the
    shards across replicas. Prefetch hides it behind FSDP2_OVERLAP of the compute, except the first group's gather
    and the last group's reduction, which have nothing to overlap with. `trained_share`: the share of parameters that
    have gradients to reduce (LoRA: the adapters)."""
    a = PRECISION_BYTES[plan.precision]
    ranks = shard_ranks(plan)
    shard_link = network.link(ranks, plan.tp)  # TP innermost, then the shard group (x cp), then replicas
    gathers = 1 if not plan.reshard_after_forward else 2
    layer_gather = collective_time("all_gather", groups.layer * a, ranks, shard_link)
    layer_reduce = collective_time("reduce_scatter", groups.layer * trained_share * FP32, ranks, shard_link)
    comm = gathers * collective_time("all_gather", groups.total * a, ranks, shard_link)
    comm += collective_time("reduce_scatter", groups.total * trained_share * FP32, ranks, shard_link)
    if plan.dp_replicate > 1:
        replica_link = network.link(plan.dp_replicate, plan.tp * ranks)
        replica_reduce = collective_time("all_reduce", groups.total * trained_share * FP32 / ranks, plan.dp_replicate,
                                         replica_link)
        comm += replica_reduce
        layer_reduce += replica_reduce * groups.layer / groups.total
    per_micro = layer_gather + layer_reduce + max(0.0, comm - FSDP2_OVERLAP * compute_micro)
    return plan.grad_accum * per_micro


def fsdp_offload_time(plan: Plan, groups: FsdpGroups, pcie_bytes_per_s: float) -> float:
    """CPUOffloadPolicy's copies per step: the fp32 shard to the GPU before every all-gather, the fp32 gradient shard
    back after every reduce-scatter."""
    if plan.offload_params != "cpu":
        return 0.0
    gathers = 1 if not plan.reshard_after_forward else 2
    shard_bytes = groups.total / shard_ranks(plan) * FP32
    return plan.grad_accum * (gathers + 1) * shard_bytes / pcie_bytes_per_s
