"""What the planner tries for Megatron-Core: tensor, pipeline (uneven splits, interleaving), context and expert
parallelism, with the distributed optimizer and sequence parallelism; every recomputation Megatron-Core has.

Pruned as dominated: Megatron without sequence parallelism when tp > 1 (same communication volume, more activation
memory) and without the distributed optimizer (reduce-scatter + all-gather move what the all-reduce moves, with less
memory), unless the user fixed them."""

from __future__ import annotations

from collections.abc import Iterator

from toolkit.numeric import divisors
from toolkit.planner.search import grid_layouts, zero_sharding_text


def layouts(model, gpus: int, nvlink_domain: int, fixed: dict, axis) -> Iterator[dict]:
    # tensor parallelism never leaves the NVLink domain (the node on HGX, the rack on NVL72): its all-reduces sit on
    # the critical path of every layer
    tps = axis("tp", [t for t in divisors(model.num_kv_heads, nvlink_domain) if model.num_attention_heads % t == 0])

    def states(tp: int) -> list[dict]:
        return [dict(distributed_optimizer=fixed.get("distributed_optimizer", True),
                     sequence_parallel=fixed.get("sequence_parallel", tp > 1))]

    yield from grid_layouts(model, gpus, fixed, axis, tps, axis("pp", range(1, model.num_layers + 1)), True, states)


def recompute_options() -> list[dict]:
    """None first; core attention or the dense MLP (recompute_modules), the first N layers of each chunk (block), or
    every layer."""
    return [dict(recompute="none"), dict(recompute="selective"), dict(recompute="selective", recompute_modules=("mlp",)),
            dict(recompute="full", block=True), dict(recompute="full")]


def label(plan) -> list[str]:
    """The plan's Megatron-Core options in the planner's table: `local-spec +sp +dopt`."""
    parts = ["local-spec"] if plan.transformer_impl == "local" else []
    parts += ["+sp"] if plan.sequence_parallel else []
    parts += ["+dopt"] if plan.distributed_optimizer else []
    return parts


sharding_text = zero_sharding_text  # how a plan shards model states: `zero=<stage>`
