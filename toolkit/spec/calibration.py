"""A calibration file (what `dmt calibrate` writes): the step-time model's free parameters fitted to measured runs on
one hardware, with the runs it was fitted on and the fit's residuals.

`dmt estimate / plan / generate / report --calibration FILE` and a recipe's `cluster.calibration` apply it; the
step-time model takes it in one place (toolkit.estimate.timing.step_time): each execution path's peak GEMM
efficiency, the host's matmul peak the fit used (the `cpu` entry only) and the link bus bandwidths `dmt health`
measured. A calibration of one hardware never applies to another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from toolkit.errors import UserInputError
from toolkit.numeric import COUNT_MAX, FINITE, SCALE_MAX, SCALE_MIN, WEEK_S
from toolkit.readers import parse_yaml, read_text
from toolkit.spec.cluster import get_gpu

FORMAT = "dmt-calibration/1"
# How a plan's GEMMs are executed, each with its own rate (toolkit/estimate/efficiency.py EXECUTION_PATHS, whose names
# these are): Megatron-Core with Transformer Engine, Megatron-Core's own `local` modules, HF modules (DeepSpeed, FSDP2).
ExecutionPath = Literal["megatron-te", "megatron-local", "hf"]


class _Strict(BaseModel):
    # a fitted rate or bandwidth of .inf or .nan would turn every prediction into inf/NaN, never a number
    model_config = ConfigDict(extra="forbid", frozen=True, **FINITE)


class PathEfficiency(_Strict):
    # plausible ends (numeric.SCALE_MIN/MAX, WEEK_S): a rate a million times off the curve, or a step's fixed cost
    # past a week, is no fit of a run, and past them the predictions overflow (1e300 s a step: OverflowError)
    compute_scale: float = Field(ge=SCALE_MIN, le=SCALE_MAX, allow_inf_nan=False,
                                 description="Fitted rate of this execution path's GEMMs and the work between them, "
                                             "relative to the fused-kernel curve (ExecutionPath.compute_scale in "
                                             "toolkit/estimate/efficiency.py; the curve's shape is kept).")
    fixed_step_s: float = Field(0.0, ge=0, le=WEEK_S, allow_inf_nan=False,
                                description="Fitted seconds every step of this execution path costs whatever its size "
                                            "(ExecutionPath.fixed_step_s); 0 where it was not fitted.")
    fitted: Literal["compute_scale", "compute_scale+fixed_step"] = Field(
        "compute_scale", description="What the runs could tell apart: the scale alone (one run), or the scale and a "
                                     "fixed per-step cost (least squares over two or more runs).")
    uncalibrated: float = Field(gt=0, description="The published compute_scale the model uses without a calibration.")
    runs: int = Field(ge=1, description="Runs of this execution path the value was fitted on.")
    fitted_width: float | None = Field(None, ge=1, le=COUNT_MAX, allow_inf_nan=False,
                                       description="The host entry only: the effective GEMM width (hidden / sqrt(tp)) "
                                                   "of the widest run fitted; a wider model's GEMMs are predicted at "
                                                   "the fitted rate of this width (ExecutionPath.fitted_width).")


class HostPeak(_Strict):
    """How the host's matmul peak in host_peak_tflops was measured: at the thread count the runs' ranks computed
    with, under the load of the moment, so a calibration taken on a busy machine and used on an idle one says so."""

    threads: int = Field(ge=1, description="Threads of the measuring matmuls: the runs' ranks per node x each rank's "
                                           "threads, at most the host's cores.")
    cores: int = Field(ge=1, description="Cores the measuring process could run on.")
    load_average: float = Field(ge=0, allow_inf_nan=False,
                                description="The host's 1-minute load average when it was measured.")
    measured_tflops: dict[str, float] = Field(description="What `dmt calibrate` measured, per precision key.")
    runs_tflops: dict[str, float] = Field(description="The best each key's runs measured at their launches.")
    raised_by: float = Field(1.0, ge=1, description="host_peak_tflops is the better of the two measurements times this: "
                                                    "the runs' GEMMs went faster than HOST_GEMM_CEILING of the "
                                                    "measured peak (it was measured while other work shared the "
                                                    "cores), so the peak is what the fastest run reached over that "
                                                    "ceiling (toolkit/estimate/calibrate.py HOST_PEAK_HEADROOM).")


class MeasuredLinks(_Strict):
    intra_node_busbw_gbps: float | None = Field(None, gt=0, description="all_reduce bus bandwidth inside a node.")
    inter_node_busbw_gbps: float | None = Field(None, gt=0, description="all_reduce bus bandwidth across nodes.")
    source: str = Field(description="The `dmt health --json` report they were read from.")


class FittedRun(_Strict):
    run_dir: str
    execution_path: ExecutionPath
    plan: str = Field(description="The run's plan, as dmt plan labels it.")
    steps: int = Field(description="Steps whose times were used (after the warm-up).")
    measured_step_time_s: float = Field(gt=0, description="Median step time after the warm-up.")
    predicted_step_time_s_before: float = Field(gt=0)
    predicted_step_time_s_after: float = Field(gt=0)
    error_before: float = Field(description="Signed: predicted / measured - 1, uncalibrated.")
    error_after: float = Field(description="Signed: predicted / measured - 1, with this calibration.")


class Residuals(_Strict):
    runs: int
    rms_error: float = Field(description="Root mean square of the runs' signed errors after the fit.")
    max_abs_error: float


class Calibration(_Strict):
    format: Literal["dmt-calibration/1"] = Field(description="This file's format.")
    hardware: str = Field(description="The catalogue entry (toolkit/presets/gpus.yaml) the runs trained on.")
    efficiency: dict[ExecutionPath, PathEfficiency] = Field(description="Fitted per execution path seen in the runs.")
    host_peak_tflops: dict[str, float] | None = Field(
        None, description="The host entry only: the matmul TFLOP/s per precision key the runs' predictions used, so "
                          "the fitted efficiencies multiply the same peak wherever the file is used.")
    host_peak: HostPeak | None = Field(None, description="The host entry only: how host_peak_tflops was measured.")
    links: MeasuredLinks | None = Field(None, description="Bus bandwidths measured by `dmt health` (--health).")
    warmup_steps: int = Field(ge=0, description="Logged steps left out of each run's median.")
    runs: list[FittedRun] = Field(min_length=1)
    residuals: dict[ExecutionPath, Residuals]
    created: str = Field(description="When `dmt calibrate` wrote it (UTC, ISO 8601).")
    machine: dict[str, str] = Field({}, description="Where it was fitted: host name, torch version.")
    source: str = Field("", exclude=True, description="Set by the loader: the file it was read from.")

    @field_validator("hardware")
    @classmethod
    def _in_catalogue(cls, name: str) -> str:
        try:
            return get_gpu(name).name
        except UserInputError as exc:
            raise ValueError(exc.message) from None

    def compute_scale(self, path: str) -> float | None:
        """The fitted compute scale of an execution path, or None where none of its runs was fitted."""
        fitted = self.efficiency.get(path)  # type: ignore[call-overload]
        return fitted.compute_scale if fitted else None

    def check_hardware(self, gpu_name: str, key: str) -> None:
        """Refuse to apply this calibration to a plan for other hardware: its efficiencies and links are another's."""
        if self.hardware != get_gpu(gpu_name).name:
            raise UserInputError(key, f"{self.source or 'the calibration'} was fitted on {self.hardware} runs; this "
                                      f"plan is for {gpu_name}: calibrate on runs of {gpu_name} (dmt calibrate) or "
                                      f"leave the calibration out")

    def describe(self) -> dict:
        """What outputs record of the calibration in use (plan.json, --json outputs)."""
        return {"file": self.source, "hardware": self.hardware, "created": self.created,
                "compute_scale": {path: fitted.compute_scale for path, fitted in self.efficiency.items()},
                "fixed_step_s": {path: fitted.fixed_step_s for path, fitted in self.efficiency.items()},
                "host_peak_tflops": self.host_peak_tflops,
                "host_peak": None if self.host_peak is None else self.host_peak.model_dump(),
                "links": None if self.links is None else self.links.model_dump(exclude={"source"})}


WHAT = "a calibration file written by `dmt calibrate`"


def parse_calibration(text: str, source: str, key: str = "--calibration") -> Calibration:
    """Check the text of a calibration file (its YAML), read from a file or uploaded to `dmt explore`; any problem is
    one UserInputError line naming `key`, `source` and the field. `source` is what outputs record as its file."""
    data = parse_yaml(text, source, key, what=WHAT)
    try:
        calibration = Calibration.model_validate(data)  # not Calibration(**data): YAML keys need not be strings
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"]) or "file"
        raise UserInputError(key, f"{source}: {field}: {error['msg']} (not a calibration `dmt calibrate` wrote; "
                                  f"run it again)") from None
    return calibration.model_copy(update={"source": source})


def load_calibration(path: Path | str, key: str = "--calibration") -> Calibration:
    """Read and check a calibration file (parse_calibration on its text)."""
    path = Path(path)
    return parse_calibration(read_text(path, key, what=WHAT), str(path), key)
