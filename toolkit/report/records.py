"""A run directory's files read back as data from elsewhere: metrics.jsonl and run_plan.json, checked against typed
models before `dmt report` or `dmt calibrate` takes a figure from them.

A run directory outlives the launch that wrote it: it is copied between machines, edited, written to by two launches,
cut short by a full disk. What these files may hold is therefore a rule, here and nowhere else:

- no NaN or Infinity anywhere (the toolkit writes null for a non-finite figure: metrics.MetricsWriter.write), and
  every figure of the right type and sign: a step time above 0, an MFU and a data wait of 0 or more, byte counts
  that are whole numbers; and plausible: no MFU above 1, no step of more than a week;
- metrics.jsonl: one JSON object a line, step numbers strictly increasing (each step logged once, in order: a resume
  moves the records of the steps it drops aside, metrics.keep_until); a last line cut short is a write the launch
  did not finish, not a record;
- run_plan.json: a status the toolkit writes, a plan (and model) the toolkit's own models accept, where the run
  trained (`launch`), the calibration the prediction used.

What breaks a rule is the run's damage: one line naming the file, the line or key, and what was expected. The records
before the first damaged line are kept (the plot draws them); no figure is measured from a damaged run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo

from toolkit.errors import UserInputError
from toolkit.numeric import WEEK_S
from toolkit.readers import parse_json, read_text
from toolkit.runtime.metrics import METRICS_FILE, RUN_FILE, is_checkpoint_record
from toolkit.spec.cluster import get_gpu
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import Plan, validated

Finite = Annotated[float, Field(allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]  # steps, bytes (strict: a float or a bool is no count)


def _at_most(high: float, what: str) -> AfterValidator:
    """A figure no run can show (a run beyond the device's peak, a step of years): the record is implausible, and a
    report that took it as measured would present it as a completed run's."""

    def check(value: float) -> float:
        if value > high:
            raise ValueError(f"implausible: {what} above {high:g}")
        return value

    return AfterValidator(check)


# a step slower than a week is no training step (a suspended job restarts, and its records start again after it)
STEP_S_MAX = WEEK_S


def _mfu_at_most_one(value: float, info: ValidationInfo) -> float:
    """A run beyond its device's datasheet peak is implausible. Not on the host entry (CPU ranks), whose peak is a
    matmul probe measured at launch (toolkit/estimate/device_peak.py): a run's own GEMMs can beat the probe, the more
    so on a loaded machine (benchmarks/calibration_cpu.md saw 1.0009), so the record is read with
    `measured_peak` in its validation context and no bound holds there."""
    if value > 1.0 and not (info.context or {}).get("measured_peak"):
        raise ValueError("implausible: a model FLOPs utilisation (the share of the devices' dense peak) above 1")
    return value


Mfu = Annotated[NonNegative, AfterValidator(_mfu_at_most_one)]
StepSeconds = Annotated[Positive, _at_most(STEP_S_MAX, "seconds a step")]
WaitSeconds = Annotated[NonNegative, _at_most(STEP_S_MAX, "seconds a step")]


class MetricsRecord(BaseModel):
    """One line of metrics.jsonl (metrics.MetricsWriter.write); other keys (epoch, data_sha, the guard's) pass."""

    model_config = ConfigDict(strict=True, extra="allow")

    step: Count
    loss: Finite | None = None
    grad_norm: NonNegative | None = None
    learning_rate: NonNegative | None = None
    step_time_s: StepSeconds | None = None
    tokens_per_s: Positive | None = None
    mfu: Mfu | None = None
    data_wait_s: WaitSeconds | None = None
    gpu_max_allocated_bytes: Count | None = None
    gpu_max_reserved_bytes: Count | None = None
    gpu_max_allocated_bytes_per_rank: list[Count] | None = None
    gpu_max_reserved_bytes_per_rank: list[Count] | None = None
    # MoE runs (toolkit/backends/megatron/moe.py): tokens routed to each expert per MoE layer, the busiest expert-
    # parallel rank's tokens over the mean (at least 1 by definition), the router's load-balancing loss
    moe_tokens_per_expert: list[list[Count]] | None = None
    moe_imbalance: Annotated[float, Field(ge=1.0, allow_inf_nan=False)] | None = None
    moe_load_balancing_loss: Finite | None = None


class CheckpointRecord(BaseModel):
    """A checkpoint's line of metrics.jsonl (loop.write_checkpoint_record)."""

    model_config = ConfigDict(strict=True, extra="allow")

    kind: Literal["checkpoint"]
    step: Count
    checkpoint: str
    blocking_s: NonNegative
    persist_s: NonNegative
    bytes: Count


class RecordedCalibration(BaseModel):
    """What a record keeps of the calibration its prediction used (spec.calibration.Calibration.describe())."""

    model_config = ConfigDict(strict=True, extra="ignore")

    file: str | None = None
    hardware: str
    created: str | None = None
    compute_scale: dict[str, Positive]
    host_peak_tflops: dict[str, Positive] | None = None
    links: dict[str, Positive | None] | None = None


class Launch(BaseModel):
    """Where and how the launch ran (toolkit/train.py's _record_launch)."""

    model_config = ConfigDict(strict=True, extra="allow")

    accelerator: Literal["gpu", "cpu"] | None = None
    device: str | None = None  # what torch named rank 0's device; "cpu" for CPU ranks
    device_gpu: str | None = None  # the catalogue entry that device is; None: one the catalogue does not know
    world_size: Annotated[int, Field(gt=0)] | None = None


class MemoryRecord(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    total: Count


class RunRecord(BaseModel):
    """run_plan.json: plan.json's prediction record (toolkit/spec/prediction.py's RecipePrediction, each figure
    optional: a toolkit before it recorded fewer), where the launch ran, and how it ended."""

    model_config = ConfigDict(strict=True, extra="allow")

    status: Literal["running", "completed", "failed"]
    error: str | None = None
    plan: dict | None = None
    model_spec: dict | None = None
    gpu: str | None = None
    execution_path: str | None = None
    step_time_s: StepSeconds | None = None
    tokens_per_s: Positive | None = None
    mfu: Mfu | None = None
    peak_tflops: Positive | None = None
    memory_bytes: MemoryRecord | None = None
    overhead_bytes: dict[str, Count] | None = None
    calibration: RecordedCalibration | None = None
    launch: Launch | None = None


@dataclass
class RunFiles:
    """A run directory's records as checked: run_plan.json (None: none there, or damaged), the metrics.jsonl records
    before any damaged line, and the damage (None: every file sound)."""

    record: dict | None
    metrics: list[dict] = field(default_factory=list)
    damage: str | None = None
    prediction: RunRecord | None = None  # run_plan.json as the typed record its figures are read from
    checkpoints: list[dict] = field(default_factory=list)  # metrics.jsonl's checkpoint records before any damage


def _fault(exc: ValidationError) -> str:
    """pydantic's first complaint as `key: what was expected, got VALUE`."""
    err = exc.errors()[0]
    where = ".".join(str(part) for part in err["loc"]) or "the top level"
    got = repr(err.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    message = err["msg"].removeprefix("Value error, ")
    message = message[0].lower() + message[1:]
    return f"{where}: {message}, got {got}" if err["type"] != "missing" else f"{where}: missing"


def _json(text: str, where: str):
    """A JSON document through the one JSON path (nesting bounded, every number finite); its problem as a
    UserInputError whose message says what is wrong."""
    return parse_json(text, where, None, None, "a JSON object (written by toolkit/train.py)")


def read_run_plan(run_dir: Path) -> tuple[dict | None, str | None]:
    """(run_plan.json checked, None), (None, its damage), or (None, None) where the directory holds none."""
    data, _, damage = _read_run_plan(run_dir)
    return data, damage


def _read_run_plan(run_dir: Path) -> tuple[dict | None, RunRecord | None, str | None]:
    """read_run_plan, with the typed record as well."""
    path = Path(run_dir) / RUN_FILE
    if not path.exists() and not path.is_symlink():
        return None, None, None
    text = read_text(path, "RUN_DIR", "a run record (written by toolkit/train.py)", "json")  # unreadable: refused
    try:
        data = _json(text, RUN_FILE)
    except UserInputError as exc:
        return None, None, f"{RUN_FILE} {exc.message}"
    if not isinstance(data, dict):
        return None, None, f"{RUN_FILE} holds a {type(data).__name__}; expected a JSON object (written by toolkit/train.py)"
    try:
        checked = RunRecord.model_validate(data, context={"measured_peak": measured_peak(data.get("gpu"))})
    except ValidationError as exc:
        return None, None, f"{RUN_FILE}: {_fault(exc)}"
    problem = _plan_problem(data)
    if problem:
        return None, None, f"{RUN_FILE}: {problem}"
    if checked.calibration is not None:  # only the fields the outputs print, each checked
        data = {**data, "calibration": checked.calibration.model_dump()}
    return data, checked, None


def _plan_problem(data: dict) -> str | None:
    """The recorded model and plan as the toolkit's own models take them (the plan's rules need the model)."""
    model = None
    try:
        if data.get("model_spec") is not None:
            model = validated(ModelSpec, data["model_spec"])
    except UserInputError as exc:
        return f"model_spec.{_field(exc.key)}: {exc.message}"
    try:
        if data.get("plan") is not None:
            validated(Plan, data["plan"], context={"model": model} if model is not None else None)
    except UserInputError as exc:
        return f"plan.{_field(exc.key)}: {exc.message}"
    try:
        if data.get("gpu") is not None:
            get_gpu(data["gpu"])
    except UserInputError as exc:
        return f"gpu: {exc.message}"
    return None


def _field(key: str) -> str:
    """A flag the plan's checks name (`--micro-batch`) as the record's field (`micro_batch`)."""
    return key.removeprefix("--").replace("-", "_")


def read_metrics_records(run_dir: Path) -> tuple[list[dict], str | None]:
    """(metrics.jsonl's step records up to the first damaged line, that line's damage or None); [] where none."""
    record, _, _ = _read_run_plan(run_dir)
    records, _, damage = read_all_records(run_dir, measured_peak((record or {}).get("gpu")))
    return records, damage


def measured_peak(gpu_name) -> bool:
    """Whether a run record's device (run_plan.json `gpu`) is the host entry, whose peak is measured, not a
    datasheet's (an unknown name is run_plan.json's own damage, reported there)."""
    try:
        return isinstance(gpu_name, str) and get_gpu(gpu_name).host
    except UserInputError:
        return False


def read_all_records(run_dir: Path, peak_measured: bool = False) -> tuple[list[dict], list[dict], str | None]:
    """(metrics.jsonl's step records, its checkpoint records, each up to the first damaged line; that line's damage
    or None). Each kind's steps increase strictly: a checkpoint's record follows its step's, once it is complete.
    `peak_measured`: the run trained on the host entry (measured_peak), whose MFU has no upper bound."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists() and not path.is_symlink():
        return [], [], None
    text = read_text(path, "RUN_DIR", "one JSON object a line (written by toolkit/train.py)", "jsonl")
    lines = text.splitlines()
    if lines and not text.endswith("\n"):  # the writer was stopped mid-line: that line was never a record
        lines = lines[:-1]
    records: list[dict] = []
    checkpoints: list[dict] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{METRICS_FILE} line {number}"
        try:
            data = _json(line, where)
        except UserInputError as exc:
            return records, checkpoints, f"{where} {exc.message}"
        if not isinstance(data, dict):
            return records, checkpoints, (f"{where} holds a {type(data).__name__}; expected a JSON object (one "
                                          f"record a step)")
        kind, model = (checkpoints, CheckpointRecord) if is_checkpoint_record(data) else (records, MetricsRecord)
        try:
            record = model.model_validate(data, context={"measured_peak": peak_measured})
        except ValidationError as exc:
            return records, checkpoints, f"{where}: {_fault(exc)}"
        if kind and record.step <= kind[-1]["step"]:
            what = "step {}" if kind is records else "the checkpoint of step {}"
            return records, checkpoints, (f"{where}: {what.format(record.step)} after {what.format(kind[-1]['step'])};"
                                          f" each is recorded once, in order (two launches writing one directory?)")
        kind.append(data)
    return records, checkpoints, None


def read_run_files(run_dir: Path) -> RunFiles:
    """Both files of a run directory, checked; the first damage found is the run's (run_plan.json's first)."""
    record, checked, damage = _read_run_plan(run_dir)
    metrics, checkpoints, metrics_damage = read_all_records(run_dir, measured_peak((record or {}).get("gpu")))
    return RunFiles(record, metrics, damage or metrics_damage, checked, checkpoints)
