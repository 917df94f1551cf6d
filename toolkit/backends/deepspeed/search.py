"""What the planner tries for DeepSpeed (HF Trainer): data parallelism and Ulysses sequence parallelism (see rules.py),
every ZeRO stage, with optimizer offload and ZeRO-Infinity's parameter offload where they apply; whole-layer
recomputation or none, then the sequence tiles and activation offload (toolkit/planner/search.py LONG_CONTEXT)."""

from __future__ import annotations

from collections.abc import Iterator

from toolkit.planner.search import LONG_CONTEXT, grid_layouts, sequence_splits, zero_sharding_text


def layouts(model, gpus: int, nvlink_domain: int, fixed: dict, axis) -> Iterator[dict]:
    def states(tp: int) -> list[dict]:
        zeros = axis("zero", [0, 1, 2, 3])
        found = [dict(zero=z) for z in zeros]
        found += [dict(zero=z, offload_optimizer="cpu") for z in zeros if z >= 1 and "offload_optimizer" not in fixed]
        if 3 in zeros and "offload_params" not in fixed and "offload_optimizer" not in fixed:  # ZeRO-Infinity
            found.append(dict(zero=3, offload_optimizer="cpu", offload_params="cpu"))
        return found

    for sp in axis("sp", sequence_splits(model, gpus, ulysses=True, seq_len=fixed.get("seq_len"))):
        for layout in grid_layouts(model, gpus // sp, fixed, axis, axis("tp", [1]), axis("pp", [1]), False, states):
            yield dict(layout, sp=sp)


def recompute_options() -> list[dict]:
    """HF models checkpoint whole layers; past that, the sequence tiles and the checkpoints' offload."""
    return [dict(recompute="none"), dict(recompute="full"), *LONG_CONTEXT]


def label(plan) -> list[str]:
    """The plan's model-state options in the planner's table: `z2 +off-opt +off-par`."""
    parts = [f"sp{plan.sp}"] if plan.sp > 1 else []
    parts += [f"z{plan.zero}"]
    parts += ["+off-opt"] if plan.offload_optimizer != "none" else []
    parts += ["+off-par"] if plan.offload_params != "none" else []
    return parts


sharding_text = zero_sharding_text  # how a plan shards model states: `zero=<stage>`
