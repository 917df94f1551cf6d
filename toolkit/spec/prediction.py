"""The prediction record as typed models: one plan's prediction (`dmt estimate --json`, each plan of `dmt plan
--json`, plan.json, a run's run_plan.json), the ranked plans of `dmt plan --json`, and plan.json's record of where a
plan came from. The JSON field names are contracts (scripts, the explorer's page, tests read them): a field is added
here, never renamed.

Typed here, below every layer that handles one; built by toolkit/planner/predict.py; printed by the CLI, answered by `dmt explore`, written by `dmt generate`, all as
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
    mtp: int = 0  # multi-token prediction modules, outside `total` (transformers builds none; Megatron-Core trains them)


class MemoryBytes(BaseModel):
    """Per-GPU bytes of the most loaded stage, by component (toolkit/estimate/memory.py's MemoryBreakdown)."""

    model_config = ConfigDict(extra="forbid")

    weights: int
    gradients: int
    optimizer: int
    activations: int
    overhead: int
    total: int


class CheckpointTime(BaseModel):
    """One checkpoint of the plan (estimate/checkpoint_cost.py) and Daly's interval between them."""

    model_config = ConfigDict(extra="forbid")

    bytes: int  # one save, all ranks together
    write_s: float  # until it is complete on storage
    blocking_s: float  # training paused by it: the whole write, or an async save's copy to host memory
    interval_s: float  # compute time between saves: interval_steps x the step time
    interval_steps: int  # Daly's optimum in whole steps (what `training.save_steps: auto` writes)
    async_save: bool  # blocking_s of an asynchronous save (--async-checkpoint), else of a synchronous one
    local_bytes: int  # the busiest rank's states on its GPU, which an async save copies to the host
    reload_s: float  # reading it back after a failure
    local: bool = False  # reloads read node-local checkpoints (checkpoint.local): reload_s at the host link
    write_bw_gbps_per_node: float | None  # None: --checkpoint-write-s gave the write time


class LostHours(BaseModel):
    """Where the expected hours beyond the failure-free compute go (estimate/goodput.py)."""

    model_config = ConfigDict(extra="forbid")

    checkpoints: float
    restarts: float
    reloads: float
    recomputed: float


class TrainingTime(_Record):
    """`--train-tokens`: the budget's whole optimizer steps at the predicted step time, failure-free (`days_compute`)
    and with checkpoints and failures (`days`, `gpu_hours`, estimate/training_time.py)."""

    only_when_given = ("cost",)

    tokens: int
    steps: int
    days_compute: float
    gpu_hours_compute: float
    days: float
    gpu_hours: float
    interruptions: float  # expected failures over the run
    goodput: float  # useful training time over elapsed time
    mtbf_h: float | None  # the job's mean time between failures; None: --failure-rate 0
    failure_rate_per_gpu_hour: float
    restart: str = "relaunch"  # the restart mode restart_s is the default of (training.restart)
    restart_s: float
    lost_h: LostHours
    checkpoint: CheckpointTime
    cost: float | None = None  # gpu_hours x --gpu-hour-price


class PackedAttention(BaseModel):
    """The attention FLOPs a recipe's packed samples cost (toolkit/planner/recipe.py packed_attention): the expected
    sum of a sample's squared document pieces where a variable-length kernel keeps documents apart, else the whole
    sequence's square; `note` says which and why (`dmt estimate --explain` prints it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    squared_pieces: float | None  # E[sum over a sample's document pieces of length^2] (tokens^2); None: seq_len^2
    note: str

    @classmethod
    def of(cls, record: dict) -> PackedAttention | None:
        """The one a prediction record (plan.json's, run_plan.json's) holds; None where it has none."""
        value = record.get("packed_attention")
        return cls.model_validate(value) if value else None


class Prediction(_Record):
    """One plan of one model on one GPU type: its memory, step time, tokens/s and MFU."""

    only_when_given = ("training_time", "explain", "packed_attention")

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
    packed_attention: PackedAttention | None = None  # a recipe's blend packs documents apart (None: it does not)


class RecipePrediction(Prediction):
    """A recipe's plan predicted on its cluster, with the model spec it was made for (so a run can be re-predicted)."""

    model_spec: dict


class PlanFile(RecipePrediction):
    """plan.json: the prediction and what the plan was made from, for `toolkit/train.py --plan` to check its files
    against (toolkit/validate/generated.py)."""

    only_when_given = (*Prediction.only_when_given, "save_interval", "lr_scaling")

    recipe: str
    auto: bool  # the recipe said `plan: auto` (the planner chose)
    recipe_path: str
    recipe_settings: dict  # the recipe as it was, to tell whether it changed since
    overrides: dict  # the plan options given on the command line
    files: list[str]  # the launch files written beside plan.json
    save_interval: dict | None = None  # `training.save_steps: auto`: the steps written and what they come from
    lr_scaling: dict | None = None  # training.lr_scaling: the rule, both batches and the numbers written


class RankedPlans(_Record):
    """`dmt plan --json`: the plans that fit, fastest first (at most --top), why the others were left out, and the
    calibration the ranking used (None: uncalibrated)."""

    plans: list[Prediction]
    rejected: dict[str, int]  # reason -> candidates rejected for it, most frequent first
    considered: int  # candidates tried, the plans among them
    calibration: dict | None
