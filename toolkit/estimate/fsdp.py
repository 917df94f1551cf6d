"""FSDP2 (torch.distributed.fsdp.fully_shard, as Accelerate applies it for the HF Trainer): bytes each GPU holds and
communication each step sends.

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

from toolkit.estimate.comm import Network, collective_time
from toolkit.estimate.params import ParamCounts
from toolkit.spec.plan import PRECISION_BYTES, Plan

FP32 = 4
# gathered layer groups alive at once while resharding: the one computing and the one prefetched (FSDP2's implicit
# forward and backward prefetch of the next group's all-gather)
GATHERED_LAYERS = 2
# Share of a micro-batch's compute that FSDP2's prefetching hides communication behind. First fitted on torchtitan's
# Llama 3.1 8B FSDP2 runs on H100s (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3,
# local batch 2 x 8192: 5,762 tokens/s/GPU on one node, 5,605 on 16) when the model sent a ring across nodes through
# one NIC. With rings through every NIC of a node (toolkit/estimate/comm.py) that row's communication is hidden at any
# value above ~0.1 (tests/unit/test_fsdp_estimate.py); the one published FSDP2 row whose communication is a large
# share of its compute, NeMo AutoModel's Llama 3 70B on 64 H100s (~60% of it, benchmarks/step_time_accuracy.md), is
# predicted within 7% at this value. Nothing published yet pins it more tightly.
FSDP2_OVERLAP = 0.55


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


def fsdp_model_states(plan: Plan, groups: FsdpGroups, optimizer_state_bytes: int) -> tuple[int, int, int, dict, int]:
    """(weights, gradients, optimizer, buffers, host bytes) on one GPU; `optimizer_state_bytes` per fp32 parameter."""
    shard = groups.total / plan.dp_shard
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


def fsdp_communication(plan: Plan, groups: FsdpGroups, network: Network, compute_micro: float,
                       trained_share: float = 1.0) -> float:
    """Exposed FSDP2 communication of one step, in seconds: every micro-batch all-gathers each group in forward (again
    in backward when resharded), reduce-scatters fp32 gradients in the shard group and, with HSDP, all-reduces the
    shards across replicas. Prefetch hides it behind FSDP2_OVERLAP of the compute, except the first group's gather
    and the last group's reduction, which have nothing to overlap with. `trained_share`: the share of parameters that
    have gradients to reduce (LoRA: the adapters)."""
    a = PRECISION_BYTES[plan.precision]
    shard_link = network.link(plan.dp_shard, plan.tp)  # TP innermost, then the shard group, then replicas
    gathers = 1 if not plan.reshard_after_forward else 2
    layer_gather = collective_time("all_gather", groups.layer * a, plan.dp_shard, shard_link)
    layer_reduce = collective_time("reduce_scatter", groups.layer * trained_share * FP32, plan.dp_shard, shard_link)
    comm = gathers * collective_time("all_gather", groups.total * a, plan.dp_shard, shard_link)
    comm += collective_time("reduce_scatter", groups.total * trained_share * FP32, plan.dp_shard, shard_link)
    if plan.dp_replicate > 1:
        replica_link = network.link(plan.dp_replicate, plan.tp * plan.dp_shard)
        replica_reduce = collective_time("all_reduce", groups.total * trained_share * FP32 / plan.dp_shard, plan.dp_replicate,
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
    shard_bytes = groups.total / plan.dp_shard * FP32
    return plan.grad_accum * (gathers + 1) * shard_bytes / pcie_bytes_per_s
