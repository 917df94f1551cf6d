"""Plan search: enumerate parallel layouts, reject by the libraries' rules and by memory, rank by predicted step time."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from toolkit.errors import UserInputError
from toolkit.estimate.comm import Network
from toolkit.estimate.lora import trainable_params
from toolkit.estimate.memory import MemoryBreakdown, fitting_memory, memory_floor
from toolkit.estimate.timing import STEP_COMPONENTS, StepTime, step_time
from toolkit.estimate.training_time import FailureInputs, expected_training_time
from toolkit.numeric import divisors
from toolkit.spec.backends import NAMES, backend_of
from toolkit.spec.calibration import Calibration
from toolkit.spec.cluster import GPU, topology_defaults
from toolkit.spec.model import ModelSpec
from toolkit.spec.options import RECOMPUTE_KEYS, default
from toolkit.spec.pipeline import PipelineSplit, balanced_layout
from toolkit.spec.plan import Plan, resolve_plan, with_block_recompute, with_recompute
from toolkit.spec.quantization import check_on_gpu

MICRO_BATCHES = (1, 2, 4, 8, 16)
# Tried after full recomputation on the HF backends, each only where the one before does not fit (they only add time):
# the MLP and the loss in sequence tiles, then also the checkpointed layer inputs in host memory
LONG_CONTEXT = (dict(recompute="full", tiled_mlp=True, tiled_loss=True),
                dict(recompute="full", tiled_mlp=True, tiled_loss=True, offload_activations="cpu"))
MAX_CP = 16
MAX_SEQUENCE_SPLIT = 64  # Ulysses or torch context-parallel ranks the HF backends are searched with
SEQUENCE_SPLIT_FROM = 32768  # the shortest sequence the HF backends' search splits
MAX_VPP = 8
MAX_EP = 64  # the widest expert parallelism published runs use (DeepSeek-V3: EP 64, arXiv:2412.19437 Sec. 3.4)


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    memory: MemoryBreakdown
    time: StepTime


@dataclass
class SearchResult:
    ranked: list[Candidate]
    rejected: Counter = field(default_factory=Counter)
    considered: int = 0
    invalid: dict[str, UserInputError] = field(default_factory=dict)  # the first error of each "invalid KEY"

    def refusal(self) -> UserInputError | None:
        """When no candidate was even a valid plan (the options pinned rule every layout out, or none was left to
        try), the error of the most frequent reason: the pinned flag at fault and why, as resolving that plan says.
        None when some were valid (and did not fit, or were slower): an empty table is then the answer."""
        if self.ranked or any(not why.startswith("invalid ") for why in self.rejected):
            return None
        for why, _ in self.rejected.most_common(1):
            return self.invalid[why]
        return UserInputError("plan", "the options given leave no parallel layout to try")


def pipeline_splits(num_layers: int, pp: int, megatron: bool, mtp_layers: int = 0) -> list[tuple[dict, list[int]]]:
    """(split options, virtual stages to try) for `pp` stages: even, or one layer fewer on the first and last stage.

    The uneven split is Llama 3's (arXiv:2407.21783 Sec. 3.3.2): Megatron-Core's num_layers_in_first/last_pipeline_stage
    without interleaving, and account_for_embedding/loss_in_pipeline_split (the same ranks, with the embedding and the
    loss taking the place of a layer) with it, since the first/last counts must divide by vpp and here cannot. Where
    neither fits (DeepSeek-V3's 61 layers and its MTP layer, Qwen3-235B's 94), Megatron-Core's
    pipeline_model_parallel_layout with a balanced layout (spec/pipeline.py balanced_layout), one per vpp.
    """
    if num_layers % pp == 0 and not mtp_layers:
        per_rank = num_layers // pp
        return [({}, divisors(per_rank, MAX_VPP) if megatron and pp > 1 else [1])]
    if not megatron or pp < 2:
        return [({}, [1])] if num_layers % pp == 0 else []
    splits = []
    if num_layers % pp == 0:
        splits.append(({}, divisors(num_layers // pp, MAX_VPP)))
    elif pp > 2 and (num_layers + 2) % pp == 0:
        per_rank = (num_layers + 2) // pp
        splits.append((dict(first_stage_layers=per_rank - 1, last_stage_layers=per_rank - 1), [1]))
        interleaved = [v for v in divisors(per_rank, MAX_VPP) if v > 1]
        if interleaved:
            splits.append((dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
                           interleaved))
    if splits and not mtp_layers:
        return splits
    layouts = [(dict(pipeline_model_parallel_layout=layout), [v]) for v in range(1, MAX_VPP + 1)
               if (layout := balanced_layout(num_layers, pp, v, mtp_layers)) is not None]
    return splits + layouts


def enumerate_layouts(model: ModelSpec, gpus: int, nvlink_domain: int, backend: str, fixed: dict) -> Iterator[dict]:
    """Every parallel layout and model-state option worth trying for one backend (micro-batch and recompute apart):
    the backend's own enumeration (toolkit/backends/<name>/search.py), with the options the user pinned."""

    def axis(name: str, values) -> list:
        return [fixed[name]] if fixed.get(name) is not None else list(values)

    for layout in backend_of(backend).search.layouts(model, gpus, nvlink_domain, fixed, axis):
        yield dict(fixed, backend=backend, **layout)


def grid_layouts(model: ModelSpec, gpus: int, fixed: dict, axis, tps: list[int], pps: list[int], megatron: bool,
                 states) -> Iterator[dict]:
    """The tp x pp x (pipeline split, vpp) x cp x ep grid, each with the model-state options `states(tp)` gives.
    `megatron`: Megatron-Core's pipeline (uneven splits, interleaving) and context parallelism are tried."""
    for tp, pp in itertools.product(tps, pps):
        if gpus % (tp * pp):
            continue
        for split, vpps in pipeline_splits(model.num_layers, pp, megatron, model.mtp_layers if megatron else 0):
            cps = [c for c in divisors(gpus // (tp * pp), MAX_CP) if megatron and c & (c - 1) == 0] or [1]
            for vpp, cp in itertools.product(axis("vpp", vpps), axis("cp", cps)):
                if vpp > 1 and not fixed.get("global_batch") and "vpp" not in fixed:
                    continue  # one micro-batch per step (the default batch) never interleaves (_check_batch)
                for ep, etp in expert_meshes(model, gpus // pp, tp, megatron, fixed, axis):
                    for state in states(tp):
                        yield dict(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, **etp, **split, **state)


def expert_meshes(model: ModelSpec, stage_ranks: int, tp: int, megatron: bool, fixed: dict,
                  axis) -> list[tuple[int, dict]]:
    """(ep, {etp}) pairs to try. The HF backends train no expert parallelism (their rules' EP_REFUSAL says why:
    `dmt plan --explain` prints it); Megatron-Core folds it (spec/moe_rules.py _check_expert_mesh): the expert TP of attention's TP or 1, and EP up to MAX_EP wherever EP x ETP
    divides a pipeline stage's ranks, beyond DP x CP too."""
    if not model.is_moe:
        return [(1, {})]
    if not megatron:
        return [(e, {}) for e in axis("ep", [1])]  # a pinned --ep > 1 is tried, for the rules' one-line refusal
    experts = divisors(model.num_experts, MAX_EP)
    pairs = []
    for etp in axis("etp", sorted({tp, 1})):
        for ep in axis("ep", experts):
            if stage_ranks % (ep * etp) == 0 and (etp == tp or ep > 1):  # ETP != TP without EP: no folding to gain
                pairs.append((ep, {} if etp == tp else {"etp": etp}))
    return pairs


def sequence_splits(model: ModelSpec, gpus: int, ulysses: bool, seq_len: int | None) -> list[int]:
    """Ranks to split a sequence over: powers of two dividing the GPUs; Ulysses' must also split the heads as
    UlyssesSPAttentionHF asserts (heads divisible, kv heads divisible or dividing). Below SEQUENCE_SPLIT_FROM tokens
    (and a length is given: --max-seq-len gives none) only 1: there a split trades data-parallel ranks for exchanges
    and only ties or loses to the same plan unsplit."""
    if seq_len is not None and seq_len < SEQUENCE_SPLIT_FROM:
        return [1]
    sizes = [d for d in divisors(gpus, MAX_SEQUENCE_SPLIT) if d & (d - 1) == 0]
    if ulysses:
        kv = model.num_kv_heads
        sizes = [d for d in sizes if model.num_attention_heads % d == 0 and (kv % d == 0 or d % kv == 0)]
    return sizes


def zero_sharding_text(plan) -> str:
    """How a plan shards model states in ZeRO's words (`zero=<stage>`): DeepSpeed's, and Megatron-Core's, whose
    distributed optimizer the planner's label shows."""
    return f"zero={plan.zero}"


def search(
    model: ModelSpec,
    gpus: int,
    gpu: GPU,
    network: Network,
    /,
    backends: tuple[str, ...] = NAMES,
    calibration: Calibration | None = None,
    **fixed,
) -> SearchResult:
    """All valid plans that fit, fastest first; `fixed` holds options the user pinned (seq_len, global_batch, ...;
    `network` among them is the scale-out tier, the Network argument's links being positional);
    a calibration (dmt calibrate) ranks them by its calibrated step times."""
    result = SearchResult(ranked=[])
    fixed = {k: v for k, v in fixed.items() if v is not None}
    if "precision" in fixed:  # every candidate shares the pinned precision and recipe: refused once, in one line
        check_on_gpu(_pinned_precision(fixed), gpu)
    fixed.setdefault("gpus_per_node", network.gpus_per_node)
    fixed = topology_defaults(gpu, fixed)
    nvlink_domain = fixed.setdefault("nvlink_domain", fixed["gpus_per_node"])
    micro_batches = [fixed.pop("micro_batch")] if "micro_batch" in fixed else list(MICRO_BATCHES)
    recompute_fixed = {k: fixed.pop(k) for k in RECOMPUTE_KEYS if k in fixed}
    for backend in backends:
        options = [recompute_fixed] if recompute_fixed else backend_of(backend).search.recompute_options()
        for layout in enumerate_layouts(model, gpus, nvlink_domain, backend, fixed):
            plans: dict[tuple | str, Plan] = {}  # the layout's plans resolved so far (_fitting)
            exhausted: set[int] = set()  # options out of memory at a smaller micro-batch
            pointless: set[int] = set()  # options with nothing to choose for this layout
            for micro in micro_batches:
                fitting = []
                for index, option in enumerate(options):
                    if index in pointless:
                        continue
                    result.considered += 1
                    if fitting and fitting[0].plan.recompute == "none":
                        # recomputation only adds time to a plan that fits without it
                        result.rejected["slower than the same plan without recomputation"] += 1
                        continue
                    if index in exhausted:
                        result.rejected["out of memory"] += 1
                        continue
                    try:
                        found = _fitting(model, gpus, gpu, micro, option, layout, plans)
                    except UserInputError as exc:
                        result.rejected[f"invalid {exc.key}"] += 1
                        result.invalid.setdefault(f"invalid {exc.key}", exc)
                        continue
                    except _NoChoice:  # one layer per chunk: the block method is plain full recomputation
                        result.considered -= 1
                        pointless.add(index)
                        continue
                    if found is None:
                        # activations only grow with the micro-batch: the larger ones cannot fit either
                        result.rejected["out of memory"] += 1
                        exhausted.add(index)
                        continue
                    fitting.append(Candidate(*found, step_time(model, found[0], gpu, network, calibration=calibration)))
                if fitting:  # of the same layout and micro-batch, only the recomputation that is fastest
                    fitting.sort(key=lambda c: c.time.total_s)
                    result.ranked.append(fitting[0])
                    if len(fitting) > 1:
                        result.rejected["slower than the same plan with other recomputation"] += len(fitting) - 1
    result.ranked.sort(key=lambda c: c.time.total_s)
    return result


class _NoChoice(Exception):
    """An option with nothing to choose for this layout."""


def _fitting(model: ModelSpec, gpus: int, gpu: GPU, micro: int, option: dict, layout: dict, plans: dict):
    """(plan, memory) of one recompute option at one micro-batch if it fits, else None. The block method takes the
    fewest layers per chunk that fit (memory falls and time rises with each one more): a bisection from the plain
    full recompute plan, which the next option reuses (`plans` keeps the layout's by micro-batch and
    settings, and the first it resolved: the others copy it, with_recompute)."""
    settings = {k: v for k, v in option.items() if k in RECOMPUTE_KEYS}
    key = (micro, repr(settings))  # a pinned --recompute-modules may be a list
    if key not in plans:
        base = plans.get("first")  # the first plan resolved of this layout: every other is a copy of it
        plans[key] = (with_recompute(base, model, settings, micro, "global_batch" in layout) if base is not None
                      else resolve_plan(model, gpus, micro_batch=micro, **layout, **settings))
        plans.setdefault("first", plans[key])
    plan = plans[key]

    def states_overflow(candidate: Plan) -> bool:  # its model states alone do not fit
        return memory_floor(model, candidate, gpu.memory_bytes) > gpu.memory_bytes

    def attempt(candidate: Plan):
        if states_overflow(candidate):
            return None
        memory = fitting_memory(model, candidate, gpu)
        return None if memory is None else (candidate, memory)

    if not option.get("block"):
        return attempt(plan)
    largest_chunk = max(max(sizes) for sizes in PipelineSplit.of(model.num_layers, plan).chunk_sizes())
    if largest_chunk < 2:
        raise _NoChoice
    if states_overflow(plan):
        # nor do any of its block plans': memory_floor ignores recompute_num_layers (MODEL_STATE_BLIND), and the only
        # rule that reads it holds for every copy of a full-recompute plan (with_block_recompute)
        return None
    low, high, found = 1, largest_chunk - 1, None  # all layers of every chunk is plain full recompute
    while low <= high:
        middle = (low + high) // 2
        if fitting := attempt(with_block_recompute(plan, model, middle)):
            found, high = fitting, middle - 1
        else:
            low = middle + 1
    return found


def best_plan(model: ModelSpec, gpus: int, gpu: GPU, network: Network | None = None, /,
              calibration: Calibration | None = None, **fixed) -> Plan:
    """The fastest plan that fits, for recipes that say `plan: auto`."""
    network = network or Network.from_catalogue(gpu, topology_defaults(gpu, fixed).get("gpus_per_node")
                                                or default("gpus_per_node"))
    backends = (fixed.pop("backend"),) if fixed.get("backend") else NAMES
    result = search(model, gpus, gpu, network, backends, calibration, **fixed)
    if not result.ranked:
        reasons = ", ".join(f"{n} {why}" for why, n in result.rejected.most_common())
        raise UserInputError("plan", f"no plan of {model.name} fits {gpus} x {gpu.name} ({reasons})")
    return result.ranked[0].plan


def rank_by_training_days(model: ModelSpec, ranked: list[Candidate], gpu: GPU, tokens: int,
                          inputs: FailureInputs) -> list[Candidate]:
    """The plans in order of their expected wall-clock time for `tokens` with checkpoints and failures (`dmt plan
    --train-tokens`): a plan with a cheaper checkpoint can beat one with a faster step. Ties keep the step-time order."""
    def days(candidate: Candidate) -> float:
        plan, memory = candidate.plan, candidate.memory
        return expected_training_time(tokens, plan, candidate.time.total_s, trainable_params(model, plan.finetune),
                                      memory.weights + memory.optimizer, gpu.pcie_bw_gbps, inputs)["days"]

    return sorted(ranked, key=days)


def why_first_beats_second(first: Candidate, second: Candidate) -> str:
    """Name the step-time components where the winner saves the most over the runner-up."""
    a, b = first.time.as_dict(), second.time.as_dict()
    parts = [k for k in STEP_COMPONENTS if k in a]
    savings = sorted(((b[k] - a[k], k) for k in parts), reverse=True)
    gain = (b["total_s"] - a["total_s"]) / b["total_s"] * 100
    named = [f"{saved:.3g} s less {k[:-2].replace('_', ' ')}" for saved, k in savings[:2] if saved > 0]
    costs = [f"{-saved:.3g} s more {k[:-2].replace('_', ' ')}" for saved, k in savings[-1:] if saved < 0]
    if not named and not costs:
        return "ties with the runner-up (the same predicted step, component by component); listed first by search order"
    return f"{gain:.1f}% faster than the runner-up: " + ", ".join(named + costs)


def _pinned_precision(fixed: dict) -> Plan:
    """The precision options pinned for a search, as a plan check_on_gpu reads (Plan's own defaults for the rest)."""
    keys = ("precision", "fp8_recipe", "fp4_recipe")
    return Plan.model_construct(**{"fp8_recipe": None, "fp4_recipe": None, **{k: fixed[k] for k in keys if k in fixed}})
