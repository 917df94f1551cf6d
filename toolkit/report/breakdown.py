"""`dmt report --breakdown`: the measured terms of a run's profiled steps (RUN_DIR/profile/, written by
toolkit/runtime/profile.py) beside the estimator's terms for the same plan (run_plan.json's step_time_breakdown_s,
toolkit/estimate/timing.py StepTime), the largest gap named in one sentence, and the straggler: the per-rank spread of
the step time and of each term, the slowest rank named with the term that makes it slow.

CPU traces: the terms the profiler's own events gave when the recording ended (breakdown/rank<R>.json). GPU traces:
compute, communication and idle from Holistic Trace Analysis over the same traces (temporal breakdown,
communication/computation overlap), the host-side terms (data wait, optimizer, checkpoint) from the events."""

from __future__ import annotations

import statistics
from pathlib import Path

from toolkit.errors import UserInputError
from toolkit.readers import read_json
from toolkit.runtime.profile import BREAKDOWN_FILE, PROFILE_DIR, TERMS

# the measured terms, as the report names them
LABELS = {"compute_s": "compute", "communication_exposed_s": "exposed communication", "data_wait_s": "data wait",
          "optimizer_s": "optimizer", "checkpoint_s": "checkpoint pause", "idle_s": "idle"}
# measured term -> the prediction's terms (StepTime's) it stands beside; none: the estimator does not model it
PREDICTED_AS = {"compute_s": ("compute_s", "offload_s"),
                "communication_exposed_s": ("tp_comm_s", "cp_comm_s", "sp_comm_s", "ep_comm_s", "pp_comm_s",
                                            "dp_comm_s"),
                "data_wait_s": (), "optimizer_s": ("optimizer_s",), "checkpoint_s": (),
                "idle_s": ("bubble_s", "fixed_s", "moe_overhead_s")}  # the GPU waits on the MoE dispatcher's host
# the estimator's own terms (StepTime's), as the report names them, and the measured term each is compared with
ESTIMATOR_LABELS = {"compute_s": "compute", "offload_s": "offload", "tp_comm_s": "tensor-parallel communication",
                    "cp_comm_s": "context-parallel communication",
                    "sp_comm_s": "sequence-parallel (Ulysses) communication",
                    "ep_comm_s": "expert-parallel communication", "pp_comm_s": "pipeline-parallel communication",
                    "dp_comm_s": "exposed data-parallel communication", "bubble_s": "pipeline bubble",
                    "fixed_s": "fixed per-step cost", "moe_overhead_s": "MoE layer overhead",
                    "optimizer_s": "optimizer"}
MEASURED_AS = {key: term for term, keys in PREDICTED_AS.items() for key in keys}
# what makes a rank the one the others wait for (exposed communication and idle are the waiting)
WORK_TERMS = ("compute_s", "data_wait_s", "optimizer_s", "checkpoint_s")


def profile_files(run_dir: Path) -> list[Path]:
    return sorted((Path(run_dir) / PROFILE_DIR).glob(BREAKDOWN_FILE.format(rank="*")))


def read_breakdown(run_dir: Path, prediction_terms: dict | None) -> dict | None:
    """The run's breakdown, or None when it has no profiled steps."""
    files = profile_files(run_dir)
    if not files:
        return None
    recorded = [_checked(path) for path in files]
    source = "torch.profiler events"
    if any(rank.get("device") == "cuda" for rank in recorded):
        recorded = with_hta(Path(run_dir) / PROFILE_DIR, recorded)
        source = "Holistic Trace Analysis (GPU kernels) and torch.profiler events (host)"
    rows = sorted(({"rank": rank["rank"], **step} for rank in recorded for step in rank.get("steps", [])),
                  key=lambda row: (row["step"], row["rank"]))
    if not rows:
        raise UserInputError("RUN_DIR", f"{files[0].parent}: the profile recorded no steps")
    per_rank = _per_rank(rows)
    measured = {term: statistics.fmean(terms[term] for terms in per_rank.values()) for term in ("step_s", *TERMS,
                                                                                                "communication_overlapped_s")}
    predicted = predicted_terms = None
    if prediction_terms:
        predicted = {term: sum(prediction_terms.get(key, 0.0) for key in keys) if keys else None
                     for term, keys in PREDICTED_AS.items()}
        predicted_terms = estimator_terms(prediction_terms)
    return {"source": source, "steps": rows, "measured": measured, "predicted": predicted,
            "predicted_terms": predicted_terms, "gap": largest_gap(measured, predicted, predicted_terms),
            "stragglers": stragglers(per_rank)}


def estimator_terms(prediction_terms: dict) -> dict:
    """The estimator's own terms (run_plan.json's step_time_breakdown_s), each with the measured term it stands
    beside: {term: {"label", "predicted_s", "measured_as"}}. The profile does not split communication by parallel
    dimension, nor idle into bubble and fixed cost, so several of them share one measured term."""
    return {key: {"label": label, "predicted_s": float(prediction_terms.get(key, 0.0)), "measured_as": MEASURED_AS[key]}
            for key, label in ESTIMATOR_LABELS.items()}


def _checked(path: Path) -> dict:
    """One rank's breakdown file as train.py writes it, or one line naming the file (a damaged or foreign file)."""
    body = read_json(path, "RUN_DIR", what="a profile breakdown (toolkit/runtime/profile.py)")
    keys = ("step", "step_s", *TERMS, "communication_overlapped_s")
    steps = body.get("steps") if isinstance(body, dict) else None
    if not (isinstance(body, dict) and isinstance(body.get("rank"), int) and isinstance(steps, list)
            and all(isinstance(step, dict) and all(isinstance(step.get(k), (int, float))
                                                   and not isinstance(step.get(k), bool) and step[k] >= 0
                                                   and step[k] < float("inf") for k in keys) for step in steps)):
        raise UserInputError("RUN_DIR", f"{path}: not a profile breakdown toolkit/train.py wrote (rank, and steps "
                                        f"with {', '.join(keys)}, each a finite number of 0 or more)")
    return body


def _per_rank(rows: list[dict]) -> dict[int, dict]:
    """Each rank's median over its profiled steps, term by term."""
    ranks: dict[int, list[dict]] = {}
    for row in rows:
        ranks.setdefault(row["rank"], []).append(row)
    keys = ("step_s", *TERMS, "communication_overlapped_s")
    return {rank: {key: statistics.median(step.get(key, 0.0) for step in steps) for key in keys}
            for rank, steps in sorted(ranks.items())}


def ratio_words(have: float, want: float) -> str:
    """measured against predicted (want > 0) in words: "2.1x predicted", "83x below predicted (1.2% of it)"."""
    ratio = have / want
    if ratio >= 1:
        return f"{_times(ratio)}x predicted"
    if ratio == 0:
        return "none measured against a prediction"
    return f"{_times(1 / ratio)}x below predicted (at {_percent(ratio)} of it)"


def _times(factor: float) -> str:
    return f"{factor:.1f}" if factor < 10 else f"{factor:.0f}"  # 2.1, 83, 1250


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.2g}%" if fraction < 0.1 else f"{fraction:.0%}"  # 1.2%, 0.35%, 83%


def largest_gap(measured: dict, predicted: dict | None, predicted_terms: dict | None = None) -> str | None:
    """One sentence: the term whose measured seconds are furthest from the prediction's, named by the estimator's
    own term where one term alone stands behind it, else by the measured term with the estimator's largest term in
    it named as the likely one (the profile cannot tell tensor- from data-parallel communication)."""
    if predicted is None:
        return None
    gaps = [(abs(measured[term] - (predicted[term] or 0.0)), term) for term in PREDICTED_AS]
    _, term = max(gaps)
    have, want = measured[term], predicted[term]
    if not want:
        return (f"largest gap: {LABELS[term]} {have:.3g} s per step, which the prediction does not model"
                if want is None else f"largest gap: {LABELS[term]} {have:.3g} s per step, predicted 0")
    figures = f"({have:.3g} s measured, {want:.3g} s predicted)"
    behind = sorted(((entry["predicted_s"], key) for key, entry in (predicted_terms or {}).items()
                     if entry["measured_as"] == term and entry["predicted_s"] > 0), reverse=True)
    if len(behind) == 1:
        return f"largest gap: {ESTIMATOR_LABELS[behind[0][1]]} {ratio_words(have, want)} {figures}"
    sentence = f"largest gap: {LABELS[term]} {ratio_words(have, want)} {figures}"
    if len(behind) > 1:
        share, key = behind[0]
        sentence += (f"; the profile does not split it by the estimator's terms, the largest of which is "
                     f"{ESTIMATOR_LABELS[key]} ({share:.3g} s of the {want:.3g} s predicted), the likely one")
    return sentence


def stragglers(per_rank: dict[int, dict]) -> dict:
    """The spread across ranks (max - min) of the step and of each term; the slowest rank, the one whose own work
    (step less its exposed communication and idle, the waiting) is largest, and the term of its work furthest above
    the other ranks'. With one rank there is no straggler."""
    keys = ("step_s", *TERMS)
    spread = {key: max(r[key] for r in per_rank.values()) - min(r[key] for r in per_rank.values()) for key in keys}
    result = {"spread_s": spread, "ranks": len(per_rank), "rank": None, "term": None, "sentence": None}
    if len(per_rank) < 2:
        return result
    work = {rank: sum(terms[t] for t in WORK_TERMS) for rank, terms in per_rank.items()}
    slowest = max(work, key=work.get)
    others = [terms for rank, terms in per_rank.items() if rank != slowest]
    excess = {t: per_rank[slowest][t] - statistics.median(o[t] for o in others) for t in WORK_TERMS}
    term = max(excess, key=excess.get)
    result.update(rank=slowest, term=term, excess_s=excess[term], sentence=(
        f"slowest rank: {slowest}, by {LABELS[term]} ({per_rank[slowest][term]:.3g} s per step against "
        f"{statistics.median(o[term] for o in others):.3g} s on the others, who wait for it)"))
    return result


def spread_sentence(stragglers_: dict) -> str | None:
    """The per-rank spread in one line: of the step, and of the term that varies most across ranks; None with one
    rank."""
    if stragglers_.get("ranks", 2) < 2:
        return None
    spread = stragglers_["spread_s"]
    term = max(TERMS, key=lambda t: spread[t])
    return (f"per-rank spread (slowest less fastest rank, medians over the profiled steps): step {spread['step_s']:.3g} "
            f"s, most in {LABELS[term]} ({spread[term]:.3g} s)")


def with_hta(directory: Path, recorded: list[dict]) -> list[dict]:
    """GPU traces, from Holistic Trace Analysis over each rank's whole recording, shared out evenly per profiled step:
    communication is its communication kernels' time (get_gpu_kernel_breakdown: NCCL kernels, never memory copies
    or sets), overlapped by its communication/computation overlap, the rest exposed; idle is its temporal
    breakdown's idle time (gaps between kernels) plus the recorded steps' time outside its first to last kernel;
    compute is the rest of the kernel span (computation kernels, and memory copies or sets under no computation).
    These partition the steps. The host terms (data wait, optimizer, checkpoint) come from the events; the GPU is
    taken to idle through them (the host fetching data, checkpointing or stepping the optimizer), so they are taken
    out of idle, and what exceeds idle out of compute: the terms still add up to the step."""
    from hta.trace_analysis import TraceAnalysis  # lazy: hta

    analysis = TraceAnalysis(trace_dir=str(directory), include_last_profiler_step=True)  # every step
    temporal = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    overlap = analysis.get_comm_comp_overlap(visualize=False).set_index("rank")
    _, kernels = analysis.get_gpu_kernel_breakdown(visualize=False, include_memory_kernels=True)
    communication_us = kernels[kernels["kernel_type"] == "COMMUNICATION"].groupby("rank")["sum (us)"].sum()
    updated = []
    for rank in recorded:
        steps = rank.get("steps", [])
        if rank["rank"] not in temporal.index or not steps:
            updated.append(rank)
            continue
        share = 1e-6 / len(steps)  # HTA's microseconds over the whole recording -> seconds per step
        row = temporal.loc[rank["rank"]]
        communication = float(communication_us.get(rank["rank"], 0.0)) * share
        ratio = float(overlap.loc[rank["rank"], "comp_comm_overlap_pctg"] or 0.0) / 100 \
            if rank["rank"] in overlap.index else 0.0
        overlapped = communication * ratio
        exposed = communication - overlapped
        busy = float(row["kernel_time(us)"] - row["idle_time(us)"]) * share
        outside = max(sum(step["step_s"] for step in steps) - float(row["kernel_time(us)"]) * 1e-6, 0.0) / len(steps)
        gpu_idle = float(row["idle_time(us)"]) * share + outside
        compute = max(busy - exposed, 0.0)
        new_steps = []
        for step in steps:
            host = sum(step[t] for t in ("data_wait_s", "optimizer_s", "checkpoint_s"))
            new_steps.append({**step, "compute_s": max(compute - max(host - gpu_idle, 0.0), 0.0),
                              "communication_exposed_s": exposed, "communication_overlapped_s": overlapped,
                              "idle_s": max(gpu_idle - host, 0.0)})
        updated.append({**rank, "steps": new_steps})
    return updated
