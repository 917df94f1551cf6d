"""What the planner tries for FSDP2: sharding over every data-parallel rank, and HSDP sharding inside an NVLink domain
(a node, or an NVL72 rack) and replicating across domains (shorter all-gathers on NVLink for one all-reduce of the shards over the network); reshard
after forward or keep the gathered layers (one all-gather less, more memory); parameters on the GPU or
CPUOffloadPolicy; torch context parallelism over powers of two. Whole-layer recomputation or none, then the sequence
tiles and activation offload (toolkit/planner/search.py LONG_CONTEXT)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from toolkit.planner.search import LONG_CONTEXT, sequence_splits


def layouts(model, gpus: int, nvlink_domain: int, fixed: dict, axis) -> Iterator[dict]:
    cps = sequence_splits(model, gpus, ulysses=False, seq_len=fixed.get("seq_len"))
    for tp, cp in itertools.product(axis("tp", [1]), axis("cp", cps)):
        if gpus % (tp * cp):  # tensor parallelism is Megatron-Core's here (rules.py)
            continue
        dp = gpus // (tp * cp)
        in_node = max(1, nvlink_domain // tp)  # HSDP shards inside the NVLink domain
        hsdp = in_node > 1 and dp > in_node and dp % in_node == 0  # a shard group must have ranks to shard over
        replicas = axis("dp_replicate", [1, dp // in_node] if hsdp else [1])
        for replicate, reshard, offload in itertools.product(replicas, axis("reshard_after_forward", [True, False]),
                                                             axis("offload_params", ["none", "cpu"])):
            yield dict(tp=tp, pp=axis("pp", [1])[0], vpp=axis("vpp", [1])[0], cp=cp,
                       ep=axis("ep", [1])[0], dp_replicate=replicate,
                       dp_shard=fixed.get("dp_shard") or max(1, dp // replicate),
                       reshard_after_forward=reshard, offload_params=offload)


def recompute_options() -> list[dict]:
    """FSDP2 checkpoints whole decoder layers; past that, the sequence tiles and the checkpoints' offload."""
    return [dict(recompute="none"), dict(recompute="full"), *LONG_CONTEXT]


def label(plan) -> list[str]:
    """`shard8 rep2 keep-gathered +off-par`: HSDP, SHARD_GRAD_OP-like, CPUOffloadPolicy."""
    parts = [f"shard{plan.dp_shard}"]
    parts += [f"rep{plan.dp_replicate}"] if plan.dp_replicate and plan.dp_replicate > 1 else []
    parts += ["keep-gathered"] if plan.reshard_after_forward is False else []
    parts += ["+off-par"] if plan.offload_params != "none" else []
    return parts


def sharding_text(plan) -> str:
    """How a plan shards model states: FSDP2's shard and replica groups."""
    return (f"dp_shard={plan.dp_shard} dp_replicate={plan.dp_replicate} "
            f"reshard_after_forward={str(plan.reshard_after_forward).lower()}")
