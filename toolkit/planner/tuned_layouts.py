"""Layouts NVIDIA tuned and published for one model, cluster and batch, and how `dmt plan --explain` reads the
planner's winner against them: where the winner is predicted more than TUNED_GAP faster than the tuned layout, it
names the step-time terms that make the difference (the model's, which the tuned run's own settings may not share,
such as Transformer Engine's TP communication overlap, which the toolkit's generated configs do not enable).

Each entry is the published run's layout as plan options; the throughput it reached is in
benchmarks/step_time_references.yaml, which measures the step model against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.estimate.comm import Network
from toolkit.estimate.timing import STEP_COMPONENTS, StepTime, step_time
from toolkit.planner.search import pipeline_splits
from toolkit.spec.cluster import GPU
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import Plan, resolve_plan

TUNED_GAP = 0.10  # the winner predicted this much faster than a tuned published layout is worth explaining


@dataclass(frozen=True)
class TunedLayout:
    model: str  # preset name
    gpus: int
    gpu: str  # catalogue name
    global_batch: int
    seq_len: int
    precision: str
    layout: dict = field(default_factory=dict)  # plan options besides the above
    source: str = ""


BRIDGE = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md"
TUNED_LAYOUTS = (
    TunedLayout("llama-3.1-70b", 64, "h100-80gb", 256, 8192, "fp8",
                dict(backend="megatron", tp=4, pp=8, vpp=5, micro_batch=1, distributed_optimizer=True,
                     sequence_parallel=True, recompute="none"), f"{BRIDGE}, release 26.04.01"),
    TunedLayout("llama-3.1-405b", 1024, "h100-80gb", 1536, 8192, "fp8",
                dict(backend="megatron", tp=8, pp=8, cp=2, vpp=8, micro_batch=1, distributed_optimizer=True,
                     sequence_parallel=True, recompute="none"), f"{BRIDGE}, release 26.06"),
    TunedLayout("qwen3-30b-a3b", 16, "h100-80gb", 1024, 4096, "fp8",
                dict(backend="megatron", ep=16, micro_batch=1, distributed_optimizer=True, recompute="none"),
                f"{BRIDGE}, release 26.04.01"),
)


def tuned_layout_for(model: ModelSpec, gpus: int, gpu: GPU, plan: Plan) -> TunedLayout | None:
    """The published tuned layout of this model on this many of this GPU at the plan's batch, sequence and
    precision, if there is one."""
    for tuned in TUNED_LAYOUTS:
        if (tuned.model, tuned.gpus, tuned.gpu, tuned.global_batch, tuned.seq_len, tuned.precision) == (
                model.name, gpus, gpu.name, plan.global_batch, plan.seq_len, plan.precision):
            return tuned
    return None


def tuned_step(model: ModelSpec, tuned: TunedLayout, gpu: GPU, network: Network) -> tuple[Plan, StepTime]:
    """The tuned layout as a plan (its fastest pipeline split where it interleaves) and its predicted step."""
    options = dict(tuned.layout, global_batch=tuned.global_batch, seq_len=tuned.seq_len, precision=tuned.precision)
    vpp = options.pop("vpp", 1)
    splits = pipeline_splits(model.num_layers, options["pp"], megatron=True) if options.get("pp", 1) > 1 else [({}, [1])]
    plans = [resolve_plan(model, tuned.gpus, vpp=vpp, **split, **options) for split, vpps in splits if vpp in vpps]
    timed = [(plan, step_time(model, plan, gpu, network)) for plan in plans]
    return min(timed, key=lambda pair: pair[1].total_s)


def against_tuned(model: ModelSpec, winner: Plan, winner_time: StepTime, gpu: GPU, network: Network) -> str | None:
    """One line for `dmt plan --explain`: the winner against the tuned published layout of the same run, naming the
    terms that make the difference where the winner is predicted more than TUNED_GAP faster; None without one."""
    tuned = tuned_layout_for(model, winner.gpus, gpu, winner)
    if tuned is None:
        return None
    _, tuned_time = tuned_step(model, tuned, gpu, network)
    gain = tuned_time.total_s / winner_time.total_s - 1
    head = f"tuned published layout {_layout(tuned)} ({tuned.source}): predicted {tuned_time.total_s:.3g} s"
    if gain <= TUNED_GAP:
        return f"{head}; the winner is within {TUNED_GAP:.0%} of it ({gain:+.1%})"
    a, b = winner_time.as_dict(), tuned_time.as_dict()
    terms = sorted(((b[k] - a[k], k) for k in STEP_COMPONENTS), reverse=True)
    named = ", ".join(f"{saved:.3g} s less {k[:-2].replace('_', ' ')}" for saved, k in terms[:2] if saved > 0)
    return (f"{head}; the winner is predicted {gain:.1%} faster: {named} (the model's terms; the tuned run may "
            f"hide some of them with settings the generated configs do not enable, such as TP communication "
            f"overlap)")


def _layout(tuned: TunedLayout) -> str:
    keys = ("tp", "pp", "vpp", "cp", "ep", "etp")
    return " ".join(f"{k}{tuned.layout[k]}" for k in keys if k in tuned.layout)
