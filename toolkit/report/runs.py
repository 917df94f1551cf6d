"""A training run directory read back: what was predicted (run_plan.json), what was measured (metrics.jsonl), whether
it finished, and the two side by side with signed errors (`dmt report`, `dmt calibrate`).

Measured figures are medians over the logged steps after the warm-up (the first `warmup` records, which pay for
allocation, compilation and caches); peak memory is the largest allocator figure any record holds (GPUs only). A run
that crashed, was killed or is still running, or that logged no more steps than the warm-up, has no measured
figures: its status says why instead of a number. So has a run whose files break the rules of what a run record may
hold (toolkit/report/records.py: its status is `damaged`, with the file, line and key), and one without run_plan.json
(`no-record`: whether it finished is not known).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.errors import UserInputError
from toolkit.estimate.calibrate import MeasuredRun, Observation
from toolkit.estimate.comm import Network
from toolkit.planner.predict import plan_label, predicted_record
from toolkit.report.records import RunRecord, read_run_files, read_run_plan
from toolkit.runtime.metrics import METRICS_FILE, RUN_FILE
from toolkit.spec.cluster import get_gpu
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import Plan, validated
from toolkit.spec.prediction import PackedAttention

if TYPE_CHECKING:
    from toolkit.spec.prediction import Prediction

DEFAULT_WARMUP = 3
MEASURED_KEYS = ("step_time_s", "tokens_per_s", "mfu", "data_wait_s", "peak_allocated_bytes", "peak_reserved_bytes")
PREDICTED_KEYS = ("step_time_s", "tokens_per_s", "mfu", "memory_bytes", "allocated_bytes")
CHECKPOINT_KEYS = ("count", "blocking_s", "persist_s", "stall_fraction")


@dataclass
class RunReport:
    """One run directory: its status, the figures measured and predicted, and their signed errors."""

    run_dir: str
    status: str  # completed | crashed | unfinished | too-few-steps | no-record | damaged
    reason: str | None
    steps: int  # logged records (of a damaged metrics.jsonl, those before the damaged line)
    last_step: int | None
    plan: dict | None  # the plan the run trained (plan.json's plan), None without run_plan.json
    gpu: str | None
    execution_path: str | None
    measured: dict = field(default_factory=lambda: dict.fromkeys(MEASURED_KEYS))
    predicted: dict = field(default_factory=lambda: dict.fromkeys(PREDICTED_KEYS))
    error: dict = field(default_factory=lambda: {"step_time": None, "memory": None})
    calibration: dict | None = None  # the calibration the prediction used (Calibration.describe())
    measured_per_rank: dict = field(default_factory=dict)  # GPUs: peak_allocated_bytes per rank, in rank order
    checkpoints: dict = field(default_factory=lambda: dict.fromkeys(CHECKPOINT_KEYS))
    # set where `dmt report --calibration` re-predicted the run: what its launch predicted (run_plan.json), the
    # prediction the calibration replaced, kept beside it: {step_time_s, step_time_error, calibration}
    launch_prediction: dict | None = None
    moe: dict | None = None  # MoE runs: the routing imbalance measured against the plan's (moe_summary)
    # `dmt report --breakdown` (or --plot): the profiled steps' measured terms beside the predicted ones
    # (toolkit/report/breakdown.py); None without either flag or without profiled steps
    breakdown: dict | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def signed_error(predicted: float | None, measured: float | None) -> float | None:
    """predicted / measured - 1: positive when the prediction is above what happened; None when either is missing."""
    if predicted is None or not measured:
        return None
    return predicted / measured - 1


def _median(values: list) -> float | None:
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return statistics.median(numbers) if numbers else None


def _peak(records: list[dict], key: str) -> int | None:
    values = [r[key] for r in records if isinstance(r.get(key), int)]
    return max(values) if values else None


def _peak_per_rank(records: list[dict], key: str) -> list[int] | None:
    lists = [r[key] for r in records if isinstance(r.get(key), list)]
    return [max(column) for column in zip(*lists)] if lists else None


def checkpoint_summary(steps: list[dict], checkpoints: list[dict]) -> dict:
    """What the run's complete checkpoints cost: how many, the median time training was paused for one and the
    median time until one was complete, and the share of the run's training time spent paused for them. That time
    is what the step records measured (each covers the steps since the one before, pauses included) plus the pauses
    of the checkpoints taken at the last logged step or after it, which no step record covers."""
    if not checkpoints:
        return {"count": 0, "blocking_s": None, "persist_s": None, "stall_fraction": None}
    timed, previous = 0.0, 0
    for record in steps:
        if record.get("step_time_s") is not None:
            timed += record["step_time_s"] * (record["step"] - previous)
        previous = record["step"]
    last = steps[-1]["step"] if steps else 0
    blocked = sum(c["blocking_s"] for c in checkpoints)
    elapsed = timed + sum(c["blocking_s"] for c in checkpoints if c["step"] >= last)
    return {"count": len(checkpoints), "blocking_s": _median([c["blocking_s"] for c in checkpoints]),
            "persist_s": _median([c["persist_s"] for c in checkpoints]),
            "stall_fraction": blocked / elapsed if elapsed > 0 else None}


def moe_summary(steps: list[dict], plan: dict | None) -> dict | None:
    """What an MoE run's routing did against what its plan assumed: the measured imbalance (the busiest expert-
    parallel rank's routed tokens over the mean, each step's worst layer; toolkit/backends/megatron/moe.py) as its
    median and maximum over the logged steps, the plan's `moe_imbalance` (the planner's memory and step time assume
    it), and whether the run went above it. None for a run that logged no routing."""
    seen = [r["moe_imbalance"] for r in steps if r.get("moe_imbalance") is not None]
    if not seen:
        return None
    planned = (plan or {}).get("moe_imbalance")
    losses = [r["moe_load_balancing_loss"] for r in steps if r.get("moe_load_balancing_loss") is not None]
    return {"steps": len(seen), "imbalance_median": statistics.median(seen), "imbalance_max": max(seen),
            "planned_imbalance": planned, "above_plan": None if planned is None else max(seen) > planned,
            "load_balancing_loss_last": losses[-1] if losses else None}


def allocator_comparable(prediction: Prediction | RunRecord) -> int | None:
    """The predicted bytes the allocator's max_memory_allocated can be compared with: the estimate less what lives
    outside PyTorch's allocator (the CUDA context) and its fragmentation margin (as benchmarks/gpu_check.py does)."""
    if prediction.memory_bytes is None:  # a run record of a toolkit before it was recorded
        return None
    overhead = prediction.overhead_bytes or {}
    return prediction.memory_bytes.total - overhead.get("cuda_context", 0) - overhead.get("allocator_margin", 0)


def predicted_figures(prediction: Prediction | RunRecord) -> dict:
    """The predicted figures a report sets beside the measured: of a run's record, or of its plan predicted again."""
    memory = prediction.memory_bytes
    return {"step_time_s": prediction.step_time_s, "tokens_per_s": prediction.tokens_per_s, "mfu": prediction.mfu,
            "memory_bytes": memory.total if memory is not None else None,
            "allocated_bytes": allocator_comparable(prediction)}


def _status(record: dict | None, metrics: list[dict], timed: int, warmup: int) -> tuple[str, str | None]:
    if record is None:
        return "no-record", f"no {RUN_FILE}: whether the run finished, and what was predicted for it, are not known"
    if record.get("status") == "failed":
        return "crashed", record.get("error") or "training raised an error"
    if record.get("status") == "running":
        return "unfinished", "no end recorded: killed, crashed without a trace, or still running"
    if metrics and not timed:
        return "too-few-steps", "metrics.jsonl has no step times (written by a toolkit before they were recorded)"
    if timed <= warmup:
        return "too-few-steps", f"{timed} timed step record(s), not more than the warm-up of {warmup}"
    return "completed", None


def read_run(run_dir: Path, warmup: int = DEFAULT_WARMUP, key: str = "RUN_DIR") -> RunReport:
    """Read one run directory (toolkit/train.py's --output-dir); not one at all is one UserInputError line."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserInputError(key, f"{run_dir} is not a directory; give a training run's output directory")
    files = read_run_files(run_dir)
    record, metrics = files.record, files.metrics
    if record is None and not metrics and files.damage is None:
        raise UserInputError(key, f"{run_dir} holds neither {RUN_FILE} nor {METRICS_FILE}: not a training run's "
                                  f"output directory")
    timed = [r for r in metrics if r.get("step_time_s") is not None]
    status, reason = ("damaged", files.damage) if files.damage else _status(record, metrics, len(timed), warmup)
    report = RunReport(run_dir=str(run_dir), status=status, reason=reason, steps=len(metrics),
                       last_step=metrics[-1].get("step") if metrics else None,
                       plan=(record or {}).get("plan"), gpu=(record or {}).get("gpu"),
                       execution_path=(record or {}).get("execution_path"),
                       calibration=(record or {}).get("calibration"))
    report.moe = moe_summary(metrics, report.plan)
    if files.prediction is not None:
        report.predicted = predicted_figures(files.prediction)
    if status != "completed":
        return report
    steady = timed[warmup:]
    step = _median([r["step_time_s"] for r in steady])
    tokens_per_step = (report.plan or {}).get("global_batch", 0) * (report.plan or {}).get("seq_len", 0)
    report.measured = {
        "step_time_s": step,
        "tokens_per_s": tokens_per_step / step if tokens_per_step and step else _median([r.get("tokens_per_s")
                                                                                        for r in steady]),
        "mfu": _median([r.get("mfu") for r in steady]),
        "data_wait_s": _median([r.get("data_wait_s") for r in steady]),
        "peak_allocated_bytes": _peak(metrics, "gpu_max_allocated_bytes"),
        "peak_reserved_bytes": _peak(metrics, "gpu_max_reserved_bytes"),
    }
    report.checkpoints = checkpoint_summary(metrics, files.checkpoints)
    per_rank = _peak_per_rank(metrics, "gpu_max_allocated_bytes_per_rank")
    if per_rank:
        report.measured_per_rank = {"peak_allocated_bytes": per_rank}
    compare_errors(report)
    return report


def compare_errors(report: RunReport) -> None:
    """The signed errors of a report's prediction: step time, and memory against the most loaded rank's allocator
    peak (the estimate is for the most loaded stage)."""
    measured_memory = max(report.measured_per_rank.get("peak_allocated_bytes") or [0]) or \
        report.measured["peak_allocated_bytes"]
    report.error = {"step_time": signed_error(report.predicted["step_time_s"], report.measured["step_time_s"]),
                    "memory": signed_error(report.predicted["allocated_bytes"], measured_memory)}


def run_subject(run_dir: Path, missing: str, key: str = "RUN_DIR"):
    """(model spec, plan, catalogue entry, run_plan.json) of what a run directory trained, for re-predicting it; a
    run_plan.json without them is one line naming `key`, with `missing` saying what to do."""
    record, damage = read_run_plan(Path(run_dir))
    if damage is not None:
        raise UserInputError(key, f"{run_dir}: {damage}")
    record = record or {}
    if not isinstance(record.get("model_spec"), dict) or not isinstance(record.get("plan"), dict):
        raise UserInputError(key, f"{run_dir}: {RUN_FILE} holds no model spec and plan {missing}")
    try:
        model = validated(ModelSpec, record["model_spec"])
        plan = validated(Plan, record["plan"], context={"model": model})
        gpu = get_gpu(str(record.get("gpu")))
    except UserInputError as exc:
        raise UserInputError("RUN_DIR", f"{run_dir}: {RUN_FILE}: {exc.key}: {exc.message}") from None
    return model, plan, gpu, record


def trained_on(record: dict) -> tuple[bool | None, str | None, str]:
    """Where a run's launch trained, from its run_plan.json `launch`: (on CPU ranks? None: not recorded, the
    catalogue entry of its device or None, words for it). The recipe's accelerator says cpu or gpu; the device rank
    0 trained on (recorded since toolkit/train.py names it) says which, and catches a GPU recipe run where CUDA was
    missing."""
    launch = record.get("launch") or {}
    device, device_gpu, accelerator = launch.get("device"), launch.get("device_gpu"), launch.get("accelerator")
    if device is not None:
        on_cpu = device == "cpu"
    else:
        on_cpu = None if accelerator is None else accelerator == "cpu"
    words = "CPU ranks" if on_cpu else (device or "GPUs")
    return on_cpu, "cpu" if on_cpu else device_gpu, words


def check_trained_on(run_dir, gpu, record: dict, key: str = "RUN_DIR") -> None:
    """A run's step times are those of the hardware it trained on: refuse to file them under its plan's `gpu` (a
    catalogue GPU) when run_plan.json says the run trained elsewhere, or does not say where."""
    on_cpu, device_gpu, words = trained_on(record)
    rule = "a calibration is for the hardware the runs used"
    if on_cpu is None:
        raise UserInputError(key, f"{run_dir}: {RUN_FILE} does not say where the run trained (launch.accelerator; "
                                  f"written by an older toolkit); {rule}: calibrate runs launched by this toolkit")
    if on_cpu and not gpu.host:
        raise UserInputError(key, f"{run_dir} trained on CPU ranks but its plan is for {gpu.name}; {rule}: train "
                                  f"CPU runs with the recipe's cluster.gpu: cpu, or calibrate runs on {gpu.name}")
    if not on_cpu and gpu.host:
        raise UserInputError(key, f"{run_dir} trained on {words} but its plan is for the host's CPU ranks (cpu); "
                                  f"{rule}: name the GPU in the recipe's cluster.gpu")
    if device_gpu is not None and device_gpu != gpu.name:
        raise UserInputError(key, f"{run_dir} trained on {words} ({device_gpu}) but its plan is for {gpu.name}; "
                                  f"{rule}: name {device_gpu} in the recipe's cluster.gpu")


def calibration_runs(reports: list[RunReport], warmup: int, key: str = "RUN_DIR") -> tuple[list, str]:
    """(the runs as `dmt calibrate` fits them, estimate.calibrate.MeasuredRun; the catalogue entry they trained on) of
    finished runs on one hardware; any other run, or runs on different hardware, is one line naming `key`."""
    runs, hardware = [], {}
    for report in reports:
        if report.status != "completed" or report.measured["step_time_s"] is None:
            raise UserInputError(key, f"{report.run_dir} is {report.status} ({report.reason}): only finished runs "
                                      f"with more logged steps than the warm-up calibrate")
        model, plan, gpu, record = run_subject(report.run_dir, "it trained (written by toolkit/train.py)", key)
        check_trained_on(report.run_dir, gpu, record, key)
        hardware[gpu.name] = report.run_dir
        threads = (record.get("launch") or {}).get("threads_per_rank")
        runs.append(MeasuredRun(Observation(model, plan, report.measured["step_time_s"]), report.run_dir,
                                plan_label(plan), max(0, report.steps - warmup),
                                threads_per_rank=threads if isinstance(threads, int) and threads > 0 else None,
                                rank_peak_tflops=record.get("peak_tflops")))
    if len(hardware) > 1:
        named = ", ".join(f"{name} ({run})" for name, run in hardware.items())
        raise UserInputError(key, f"the runs trained on different hardware: {named}; a calibration is for one")
    return runs, next(iter(hardware))


def repredict(report: RunReport, calibration) -> None:
    """Replace a report's prediction with the same plan's re-predicted with `calibration` (dmt report --calibration),
    keeping the launch's step time prediction and its error beside it (launch_prediction). On the host entry the
    calibration brings its own peak: the measured MFU is restated against it, so measured and predicted MFU keep one
    denominator."""
    if report.status == "damaged":  # nothing sound to re-predict; its status says why
        return
    model, plan, gpu, record = run_subject(report.run_dir, "to re-predict (written by an older toolkit); report it "
                                                           "without --calibration", "--calibration")
    calibration.check_hardware(gpu.name, "--calibration")
    prediction = predicted_record(model, plan, gpu, Network.from_catalogue(gpu, plan.gpus_per_node), calibration,
                                  packed=PackedAttention.of(record))
    report.launch_prediction = {"step_time_s": report.predicted["step_time_s"],
                                "step_time_error": report.error["step_time"], "calibration": report.calibration}
    report.predicted = predicted_figures(prediction)
    report.calibration = prediction.calibration
    before, after = record.get("peak_tflops"), prediction.peak_tflops
    if report.measured["mfu"] is not None and before and after:  # the host peak of the calibration, not the launch's
        report.measured["mfu"] *= before / after
    if report.status == "completed":
        compare_errors(report)
