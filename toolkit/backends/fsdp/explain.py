"""What `dmt estimate --explain` says of FSDP2's own terms: fp32 shards over dp_shard (x cp; HSDP replicas), gathered
copies, fp32 gradient shards and CPUOffloadPolicy.

Each function answers one question toolkit/estimate/explain.py asks every backend; None: the common sentence."""

from __future__ import annotations

from toolkit.backends.fsdp.memory import shard_ranks
from toolkit.spec.plan import Plan


def one_replica(plan: Plan) -> dict:
    """Options beyond dp = 1 that put the plan on one data-parallel replica: one shard of one replica."""
    return dict(dp_shard=1, dp_replicate=1)


def sharded_over(plan: Plan) -> str:
    """The ranks FSDP2 shards over as a sentence names them: dp_shard, or dp_shard x cp (Accelerate's dp_shard_cp
    mesh) with context parallelism; the count is the memory model's (memory.shard_ranks)."""
    return f"dp_shard x cp = {plan.dp_shard} x {plan.cp} = {shard_ranks(plan)}" if plan.cp > 1 else \
        f"dp_shard = {shard_ranks(plan)}"


def sharding(plan: Plan) -> str:
    replicas = f", replicated {plan.dp_replicate} times (HSDP)" if plan.dp_replicate > 1 else ""
    return f"FSDP2 over {sharded_over(plan)}{replicas}"


def weights(plan: Plan) -> tuple[str | None, str | None]:
    """(what the weights are, why they differ from the rule of thumb)."""
    if plan.offload_params != "none":
        why = "FSDP2's CPUOffloadPolicy keeps the shards in host memory; only gathered copies reach the GPU"
    else:
        why = (f"FSDP2 keeps a 1/{shard_ranks(plan)} fp32 shard of every parameter and gathers {plan.precision} copies "
               f"group by group (fsdp_gathered_params, under overhead)")
    return "fp32 parameters: Accelerate upcasts them for FSDP2 mixed precision", why


def gradients(plan: Plan) -> tuple[str, str]:
    """(the rule, why it differs from 16-bit gradients on every GPU)."""
    return (f"fp32 gradient shards (the fp32 reduce-scatter's output): 1/{shard_ranks(plan)} per GPU",
            f"FSDP2 reduce-scatters every micro-batch's gradients in fp32 over {sharded_over(plan)}")


def optimizer_offloaded(plan: Plan) -> str | None:
    """Why no optimizer state is on the GPU, when none is."""
    if plan.offload_params == "none":
        return None
    return "FSDP2's CPUOffloadPolicy steps the optimizer in host memory: none on the GPU"


def master_copy(plan: Plan) -> str | None:
    """Whether the weights are their own master copy in every precision (the sentence saying so): they are."""
    return "FSDP2's fp32 weights are the master copy, its gradients fp32 too"


def fp32_gradients(plan: Plan) -> str:
    """Who keeps fp32 gradients, when a replica pays more than the ZeRO paper's 16 B/param."""
    return "FSDP2 keeps fp32 gradient shards"
