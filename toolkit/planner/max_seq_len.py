"""The longest sequence a plan trains (`dmt estimate --max-seq-len`) and the plans that train the longest one
(`dmt plan --max-seq-len`): memory only grows with the sequence, so a doubling then a bisection over multiples of
SEQ_LEN_STEP finds it, and the next multiple says what stops it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from toolkit.errors import UserInputError
from toolkit.estimate.comm import Network
from toolkit.estimate.memory import MemoryBreakdown, estimate_memory, exceeded
from toolkit.estimate.timing import step_time
from toolkit.planner.search import enumerate_layouts
from toolkit.spec.backends import backend_of
from toolkit.spec.cluster import GPU, topology_defaults
from toolkit.spec.model import ModelSpec
from toolkit.spec.options import RECOMPUTE_KEYS
from toolkit.spec.plan import Plan, resolve_plan

SEQ_LEN_STEP = 1024
MAX_SEQ_LEN = 2**28  # 268M tokens: where the search stops looking (the answer is then "at least this")


@dataclass(frozen=True)
class Longest:
    """The longest multiple of the step that fits (0: not even the first), its plan, and what stops the next one."""

    max_seq_len: int
    plan: Plan | None  # the plan at max_seq_len (None when nothing fits)
    limit: dict  # at the next length: seq_len, where (gpu or host), component, bytes, total_bytes, capacity_bytes

    def as_json(self) -> dict:
        return {"max_seq_len": self.max_seq_len, "limit": self.limit}


def seq_len_step(options: dict) -> int:
    """Multiples of 1024 every rule on the length takes: 2 x cp for context parallelism, sp for Ulysses."""
    cp, sp = options.get("cp") or 1, options.get("sp") or 1
    return math.lcm(SEQ_LEN_STEP, 2 * cp if cp > 1 else 1, sp)


def limit_of(memory: MemoryBreakdown, gpu: GPU, plan: Plan, seq_len: int) -> dict:
    """What stops a length: on the GPU, its largest term (a component or an overhead entry: activations,
    tiled_loss_tile, ...); on the host, the RAM offload needs per node."""
    where = exceeded(memory, gpu, plan.gpus_per_node)
    if where is not None and where[0] == "host":
        return dict(seq_len=seq_len, where="host", component="host_memory", bytes=where[1], total_bytes=where[1],
                    capacity_bytes=gpu.host_memory_bytes)
    terms = {k: v for k, v in memory.as_dict().items() if k not in ("overhead", "total")}
    terms.update(memory.overhead_detail)
    component = max(terms, key=terms.get)
    return dict(seq_len=seq_len, where="gpu", component=component, bytes=terms[component], total_bytes=memory.total,
                capacity_bytes=gpu.memory_bytes)


def longest_sequence(model: ModelSpec, gpus: int, gpu: GPU, **options) -> Longest:
    """The longest multiple of seq_len_step(options) this plan fits at, and the limit at the next one."""
    options = topology_defaults(gpu, {k: v for k, v in options.items() if k != "seq_len"})
    step = seq_len_step(options)

    def attempt(multiple: int) -> tuple[Plan, MemoryBreakdown, bool]:
        plan = resolve_plan(model, gpus, seq_len=multiple * step, **options)
        memory = estimate_memory(model, plan)
        return plan, memory, exceeded(memory, gpu, plan.gpus_per_node) is None

    good, bad = 0, 1
    found = None
    while True:  # double until a length does not fit
        plan, memory, fits = attempt(bad)
        if not fits:
            failed = (plan, memory)
            break
        good, found = bad, plan
        if bad * step >= MAX_SEQ_LEN:
            return Longest(bad * step, plan, dict(seq_len=None, where=None, component=None, bytes=None,
                                                  total_bytes=None, capacity_bytes=None))
        bad *= 2
    while bad - good > 1:
        middle = (good + bad) // 2
        plan, memory, fits = attempt(middle)
        if fits:
            good, found = middle, plan
        else:
            bad, failed = middle, (plan, memory)
    return Longest(good * step, found, limit_of(failed[1], gpu, failed[0], bad * step))


@dataclass(frozen=True)
class LongestPlan:
    longest: Longest
    step_time_s: float


def longest_plans(model: ModelSpec, gpus: int, gpu: GPU, network: Network, backends: tuple[str, ...], /,
                  calibration=None, **fixed) -> tuple[list[LongestPlan], int]:
    """Every layout and memory option the planner tries (micro-batch 1 unless pinned), each at its longest sequence,
    ranked by that length, then by its step time there; and how many were considered."""
    fixed = {k: v for k, v in fixed.items() if v is not None and k != "seq_len"}
    fixed.setdefault("gpus_per_node", network.gpus_per_node)
    fixed = topology_defaults(gpu, fixed)
    nvlink_domain = fixed.setdefault("nvlink_domain", fixed["gpus_per_node"])
    fixed.setdefault("micro_batch", 1)
    pinned = {k: fixed.pop(k) for k in RECOMPUTE_KEYS if k in fixed}
    found, considered = [], 0
    for backend in backends:
        options = [pinned] if pinned else [o for o in backend_of(backend).search.recompute_options()
                                           if not o.get("block")]
        for layout in enumerate_layouts(model, gpus, nvlink_domain, backend, fixed):
            for option in options:
                considered += 1
                try:
                    longest = longest_sequence(model, gpus, gpu, **layout, **option)
                except UserInputError:
                    continue
                if longest.plan is None:
                    continue
                found.append(LongestPlan(longest, step_time(model, longest.plan, gpu, network,
                                                            calibration=calibration).total_s))
    found.sort(key=lambda c: (-c.longest.max_seq_len, c.step_time_s))
    return found, considered
