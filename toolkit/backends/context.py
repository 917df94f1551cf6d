"""TrainContext: what toolkit/train.py hands every backend's `train` (toolkit/backends/<name>/train.py) for a launch;
HFLaunch: what a launch under the HF Trainer adds to it, shared by ToolkitTrainer and ToolkitCallback."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from toolkit.backends.hf_guard import TrainerGuard
    from toolkit.backends.hf_hooks import TrainerHooks
    from toolkit.backends.hf_saves import TrainerSaves
    from toolkit.backends.loop import BatchFingerprints
    from toolkit.runtime.metrics import MetricsWriter, Throughput
    from toolkit.runtime.profile import StepProfiler
    from toolkit.runtime.supervision import TrainingWatchdog
    from toolkit.spec.model import ModelSpec
    from toolkit.spec.plan import Plan
    from toolkit.spec.recipe import Recipe
    from toolkit.validate.generated import GeneratedRun


@dataclass(frozen=True)
class TrainContext:
    # the plan and the generated files' contents (plan.json's directory); a launch without --plan has the plan only, and
    # the backend's generators make its files in memory
    run: GeneratedRun
    # the run's recipe with the command line's step overrides applied (its schedule, the generated DeepSpeed config
    # and trainer arguments all see them)
    recipe: Recipe
    output_dir: Path  # checkpoints, metrics.jsonl, run_plan.json
    resume: str | None  # --resume: "latest", "auto", a checkpoint's path, or None (a fresh start)
    deepspeed_json: str | None  # --deepspeed: a DeepSpeed JSON for a launch without --plan
    # the command line's step overrides (max_steps, save_steps) under the trainer arguments' names: what
    # trainer_args.json takes over its own values
    updates: dict
    throughput: Throughput  # turns this rank's step times into tokens/s and MFU (train.py's _record_launch)
    watch: TrainingWatchdog  # this rank's watchdog: the phases of each step, a hang's report

    @property
    def plan(self) -> Plan:
        return self.run.plan

    @property
    def model(self) -> ModelSpec:
        return self.run.model


@dataclass(frozen=True)
class HFLaunch:
    """One launch under the HF Trainer: what ToolkitTrainer and ToolkitCallback act through."""

    context: TrainContext
    hooks: TrainerHooks  # what DeepSpeed or FSDP2 adds to the HF Trainer (the backend's train.py TRAINER_HOOKS)
    world: int  # the launch's processes
    identity: dict  # the run a checkpoint belongs to (toolkit.backends.resume.run_identity)
    consumed: int  # samples the checkpoint resumed from had consumed: a blend's sampler reads on from there
    flat: bool  # the micro-batch comes flattened into one row (toolkit.backends.hf_inputs.TrainerData.flat)
    fingerprints: BatchFingerprints  # which samples each step trains on (metrics.jsonl's data_sha)
    metrics: MetricsWriter
    guard: TrainerGuard  # the NaN/spike guard on the Trainer
    saves: TrainerSaves | None  # checkpoints written in the background (training.async_save), else None
    profiler: StepProfiler  # the recipe's training.profile on this rank (inactive when off)
