"""How many forwards a pipeline rank keeps alive at its peak, under Megatron-Core 0.16's schedules.

The layer split itself is `toolkit.spec.pipeline.PipelineSplit` (a rule of the plan). The schedule follows
`get_pp_rank_microbatches` and `get_schedule_table` (megatron/core/pipeline_parallel/schedules.py): rank r runs
pp - r - 1 warm-up forwards without interleaving, 2 (pp - r - 1) + (vpp - 1) N with it (N =
microbatch_group_size_per_vp_stage, default pp), at most every forward of the step; one more forward is alive when
its first backward starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice


def peak_forwards(pp: int, vpp: int, stage: int, micro_batches: int) -> list[int]:
    """The virtual stage of every forward pass rank `stage` holds activations for when its first backward starts."""
    if pp == 1:
        return [0]
    total = micro_batches * vpp
    if vpp == 1:
        warmup = pp - stage - 1
    else:
        warmup = 2 * (pp - stage - 1) + (vpp - 1) * pp
    alive = min(warmup + 1, total)
    return [chunk for _, chunk in islice(_forward_order(micro_batches, vpp, pp), alive)]


def _forward_order(micro_batches: int, vpp: int, group: int) -> Iterator[tuple[int, int]]:
    """(micro-batch, virtual stage) in forward order: groups of `group` micro-batches run through every chunk.
    Lazily: only the first few are asked for, of what may be a global batch of 10**9 micro-batches."""
    for first in range(0, micro_batches, group):
        last = micro_batches if first + group >= micro_batches else first + group
        for chunk in range(vpp):
            for mb in range(first, last):
                yield mb, chunk
