"""The prediction record as typed models: one plan's prediction (`dmt estimate --json`, each plan of `dmt plan
--json`, plan.json, a run's run_plan.json), the ranked plans of `dmt plan --json`, and plan.json's record of where a
plan came from. The JSON field names are contracts (scripts, the explorer's page, tests read them): a field is added
here, never renamed.

Typed here, below every layer that handles one; built by toolkit/planner/report.py; printed by the CLI, answered by `dmt explore`, written by `dmt generate`, all as
`as_json()` of one of these, so every output of a prediction holds the same keys.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, model_serializer

from toolkit.spec.plan import Plan


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)  # extras attached later are checked too

    # fields written only when given (`--train-tokens`, `--explain`): the JSON is unchanged otherwise
    only_when_given: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _leave_out_what_was_not_given(self, handler):
        data = handler(self)
        for name in self.only_when_given:
            if data.get(name) is None:
                data.pop(name, None)
        return data

    def as_json(self) -> dict:
        """The record as JSON types, in the order of its fields (a plan's tuples as lists)."""
        return self.model_dump(mode="json")


class ParamCounts(BaseModel):
    model_config = ConfigDict(extra="forbid")

    total: int
    embedding: int
    active: int
    trainable: int  # what the optimizer updates: all parameters, or a LoRA's adapters


class MemoryBytes(BaseModel):
    """Per-GPU bytes of the most loaded stage, by component (toolkit/estimate/memory.py's MemoryBreakdown)."""

    model_config = ConfigDict(extra="forbid")

    weights: int
    gradients: int
    optimizer: int
    activations: int
    overhead: int
    total: int


class TrainingTime(BaseModel):
    """`--train-tokens`: the budget's whole optimizer steps at the predicted step time (estimate/training_time.py)."""

    model_config = ConfigDict(extra="forbid")

    tokens: int
    steps: int
    days: float
    gpu_hours: float


class Prediction(_Record):
    """One plan of one model on one GPU type: its memory, step time, tokens/s and MFU."""

    only_when_given = ("training_time", "explain")

    model: str
    family: str
    params: ParamCounts
    plan: Plan
    gpu: str
    gpu_memory_bytes: int
    memory_bytes: MemoryBytes
    overhead_bytes: dict[str, int]
    host_memory_bytes_per_gpu: int
    most_loaded_stage: int
    params_per_gpu: int
    fits: bool
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    mfu_definition: str
    execution_path: str
    peak_tflops: float
    calibration: dict | None  # Calibration.describe() of the calibration used; None: uncalibrated
    step_time_breakdown_s: dict[str, float]
    training_time: TrainingTime | None = None
    explain: list[dict] | None = None  # `--explain`: toolkit/estimate/explain.py's entries


class RecipePrediction(Prediction):
    """A recipe's plan predicted on its cluster, with the model spec it was made for (so a run can be re-predicted)."""

    model_spec: dict


class PlanFile(RecipePrediction):
    """plan.json: the prediction and what the plan was made from, for `toolkit/train.py --plan` to check its files
    against (toolkit/validate/generated.py)."""

    recipe: str
    auto: bool  # the recipe said `plan: auto` (the planner chose)
    recipe_path: str
    recipe_settings: dict  # the recipe as it was, to tell whether it changed since
    overrides: dict  # the plan options given on the command line
    files: list[str]  # the launch files written beside plan.json


class RankedPlans(_Record):
    """`dmt plan --json`: the plans that fit, fastest first (at most --top), why the others were left out, and the
    calibration the ranking used (None: uncalibrated)."""

    plans: list[Prediction]
    rejected: dict[str, int]  # reason -> candidates rejected for it, most frequent first
    considered: int  # candidates tried, the plans among them
    calibration: dict | None
