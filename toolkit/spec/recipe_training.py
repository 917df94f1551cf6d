"""The recipe's `training:` section (hyper-parameters, schedule, logging, restarts, the NaN guard, the profiler) and
the sections of how checkpoints are kept and what DeepSpeed alone is told: `checkpoint:` and `deepspeed:`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from toolkit.numeric import SEED_MAX, Seed
from toolkit.spec.recipe_data import Section


class GuardSection(Section):
    """The NaN and loss-spike guard: judged on every optimizer step, on the loss of the whole global batch."""

    on_nan: Literal["stop", "skip", "rollback"] = Field(
        "stop", description="What a non-finite loss or gradient norm, or a loss spike, does: stop (save nothing, "
                            "exit code 4, no automatic restart), skip (drop that optimizer step; the learning-rate "
                            "schedule does not advance), rollback (reload the latest verified checkpoint and go on "
                            "with the data after the offending step: the steps since the checkpoint are dropped).")
    spike_factor: float = Field(0.0, ge=0, description="A loss above this many times the median of the last `window` "
                                                       "steps is a spike (e.g. 3); 0: no spike rule.")
    window: int = Field(50, gt=0, description="Steps in the running median of the spike rule; the rule judges once "
                                              "that many steps are known.")

    @field_validator("spike_factor")
    @classmethod
    def _above_one(cls, factor: float) -> float:
        if 0 < factor <= 1:
            raise ValueError(f"must be 0 (off) or above 1 (3 = three times the median), got {factor}")
        return factor


class ProfileSection(Section):
    """torch.profiler on chosen steps and ranks (toolkit/runtime/profile.py): each rank's trace in RUN_DIR/profile/
    (Chrome/Perfetto JSON that TensorBoard's profiler and Holistic Trace Analysis open) and the measured breakdown
    `dmt report --breakdown` sets beside the prediction. Off unless set (toolkit/train.py --profile-steps A-B)."""

    start_step: int = Field(gt=0, description="The first optimizer step recorded (1-based, as metrics.jsonl counts).")
    steps: int = Field(2, gt=0, description="Consecutive steps recorded from start_step on.")
    ranks: list[Annotated[int, Field(ge=0)]] | None = Field(None, description="Ranks that record (e.g. [0, 1]); "
                                                                              "default: every rank.")
    memory: bool = Field(False, description="Also record allocations: each recording CPU rank writes torch's "
                                            "memory timeline (profile/rank<R>.memory.html and its events, "
                                            "profile/memory/rank<R>.json), each GPU rank its allocator snapshot "
                                            "(profile/rank<R>.memory.pickle, pytorch.org/memory_viz); slower.")

    @property
    def last_step(self) -> int:
        return self.start_step + self.steps - 1


# A run's start (the phase before its first step: the checkpoint writer process, the data, the first heartbeat) may
# take this many hang timeouts before the watchdog or NVRx's rank monitor calls it a hang: its bounded waits alone
# (the checkpoint writer's start, at most half a hang timeout) must fit in it beside work no step repeats
STARTUP_FACTOR = 2


def heartbeat_interval_s(hang_timeout_s: float) -> float:
    """How often every rank beats and the monitors look: 20 per hang timeout, within [0.25, 5] s (thousands of ranks
    share one store). The toolkit's watchdog and NVRx's workload_check_interval alike."""
    return min(max(hang_timeout_s / 20, 0.25), 5.0)


class TrainingSection(Section):
    seq_len: int = Field(gt=0, description="Tokens per packed training sequence.")
    global_batch: int = Field(gt=0, description="Sequences per optimizer step.")
    max_steps: int = Field(gt=0, description="Optimizer steps to train (the schedule's length).")
    learning_rate: float = Field(gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate of the cosine schedule, as a share "
                                                             "of the peak.")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after the warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps from 0 to the peak learning rate.")
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "none", description="How learning_rate and warmup_steps follow the global batch when it differs from "
                            "lr_reference_batch: linear or sqrt in the batch for the rate, inversely for the warm-up "
                            "steps (the same samples); dmt generate writes the scaled numbers (toolkit/spec/"
                            "lr_scaling.py).")
    lr_reference_batch: int | None = Field(None, gt=0, description="The global batch (sequences) learning_rate and "
                                                                   "warmup_steps were tuned at; required by "
                                                                   "lr_scaling linear or sqrt.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled (AdamW) weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1 (SGD momentum).")
    adam_beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this (0: no clipping).")
    seed: Seed = Field(42, description=f"Seed of the model init and the data order (0 to {SEED_MAX}, what numpy's "
                                       f"seed, which HF's set_seed calls, accepts).")
    logging_steps: int = Field(1, gt=0, description="Write a metrics.jsonl record every N steps.")
    save_steps: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        0, description="Checkpoint every N steps (0: only at the end); auto: Daly's optimum interval for the planned "
                       "step time, the checkpoint's cost and the expected failures (toolkit/planner/save_interval.py), "
                       "written by `dmt generate` into the generated files and recorded in plan.json.")
    async_save: bool | None = Field(None, description="Write each checkpoint in the background while training goes "
                                                      "on (Megatron-Core: dist_checkpointing's asynchronous save on its "
                                                      "persistent writer process); its manifest and `latest` follow "
                                                      "once every rank's files are complete. Unset: on where the "
                                                      "backend saves asynchronously (Megatron-Core) on GPUs; on CPU "
                                                      "ranks when true; DeepSpeed and FSDP2 save synchronously today, "
                                                      "and say so.")
    eval_steps: int = Field(0, ge=0, description="Evaluate on the held-out split every N steps (0: never).")
    report_to: list[Literal["wandb", "tensorboard", "none"]] = Field(
        ["none"], description="Loggers besides metrics.jsonl; wandb runs offline when no API key is configured.")
    hang_timeout_s: float = Field(600.0, ge=0, description="A rank whose heartbeat stops, or a step or collective "
                                                           "that no rank leaves, for this long is named in "
                                                           "OUTPUT/incident.json with the Python stacks, and every "
                                                           "rank exits (code 3) for the launcher to restart the job. "
                                                           "Longer than the slowest step and checkpoint save; 0: no "
                                                           "watchdog.")
    max_restarts: int = Field(3, ge=0, description="Restarts of a failed job from the latest verified checkpoint by "
                                                   "launch.sh and slurm.sbatch (torchrun's --max-restarts; a retry "
                                                   "loop for the deepspeed and accelerate launchers); 0: none.")
    restart: Literal["relaunch", "in_process"] = Field(
        "relaunch", description="How a failed job continues from the latest verified checkpoint. relaunch: every rank "
                                "is ended and the launcher starts them all again (training.max_restarts times). "
                                "in_process: NVIDIA Resiliency Extension's in-process restart (Megatron-Core "
                                "and FSDP2 backends): the training function restarts inside the surviving processes, "
                                "a hot spare (training.spare_ranks) replacing a rank that died or hung; launch.sh's "
                                "`inprocess` launcher (docs/faults.md).")
    spare_ranks: int = Field(1, ge=0, description="training.restart: in_process: processes launched beyond "
                                                  "cluster.gpus that wait as hot spares and take the place of a "
                                                  "rank lost during training (one loss each).")
    guard: GuardSection = Field(GuardSection(), description="What a non-finite loss or gradient norm, or a loss "
                                                            "spike, does to the run.")
    profile: ProfileSection | None = Field(None, description="Record steps with torch.profiler (unset: off, no "
                                                             "cost): traces and the measured breakdown in "
                                                             "RUN_DIR/profile/.")

    @model_validator(mode="after")
    def _lr_reference(self) -> "TrainingSection":
        if self.lr_scaling != "none" and self.lr_reference_batch is None:
            raise ValueError(f"lr_scaling {self.lr_scaling} needs training.lr_reference_batch, the global batch "
                             f"learning_rate was tuned at")
        return self


class DeepSpeedSection(Section):
    """DeepSpeed-only choices that the parallel plan does not model."""

    zero_plus_plus: bool = Field(False, description="ZeRO++ for ZeRO-3 across nodes: hpZ keeps a secondary parameter "
                                                    "partition inside each node (zero_hpz_partition_size = gpus_per_node) "
                                                    "and weights and gradients travel quantized.")
    auto_values: bool = Field(False, description='Write "auto" for every value HF Trainer fills in (batch sizes, '
                                                 "clipping, precision, optimizer and scheduler numbers) instead of "
                                                 "the explicit numbers.")


class LocalCheckpointSection(Section):
    """Node-local checkpoints through NVIDIA Resiliency Extension's LocalCheckpointManager (docs/faults.md)."""

    dir: str = Field(min_length=1, description="Node-local directory of the local checkpoints (each rank writes "
                                               "DIR/<run name>/<rank>/); relative: to the run's output directory.")
    every: int = Field(1, gt=0, description="A local checkpoint every N steps; the persistent ones stay at "
                                            "training.save_steps, and a resume reads the newer of the two.")
    replication: int = Field(1, ge=1, description="Copies of each rank's local checkpoint, kept by peer ranks on "
                                                  "other nodes (NVRx's CliqueReplicationStrategy); 1: none. NVRx "
                                                  "0.4.1 receives replicas through CUDA buffers: GPUs only.")


class CheckpointSection(Section):
    """Checkpoints beside the persistent ones of training.save_steps."""

    local: LocalCheckpointSection | None = Field(None, description="Node-local checkpoints (NVRx), unset: none.")
