"""Wall-clock days and GPU-hours of a whole training run, from a plan's predicted step time and a token budget: the
failure-free figure, and the expected one with checkpoints and failures (goodput.py, checkpoint_cost.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from toolkit.estimate.checkpoint_cost import WRITE_BW_GBPS_PER_NODE, CheckpointCost, checkpoint_cost
from toolkit.estimate.goodput import (
    FAILURE_RATE_PER_GPU_HOUR,
    RESTART_MODES,
    SECONDS_PER_HOUR,
    daly_interval_s,
    mean_time_between_failures_s,
    run_with_failures,
)
from toolkit.spec.backends import backend_of
from toolkit.spec.cluster import get_gpu

if TYPE_CHECKING:
    from toolkit.spec.plan import Plan
    from toolkit.spec.prediction import Prediction

SECONDS_PER_DAY = 86400


@dataclass(frozen=True)
class FailureInputs:
    """What the run's failures and checkpoints are assumed to be (the flags of `--train-tokens`)."""

    failure_rate_per_gpu_hour: float = FAILURE_RATE_PER_GPU_HOUR
    restart: str = "relaunch"  # training.restart: relaunch | in_process (its default restart_s)
    restart_s: float | None = None  # None: the restart mode's default (goodput.RESTART_MODES)
    local_checkpoint: bool = False  # reloads read node-local checkpoints (checkpoint.local)
    write_bw_gbps_per_node: float = WRITE_BW_GBPS_PER_NODE
    write_s: float | None = None  # a measured write time, instead of bytes / bandwidth
    async_save: bool | None = None  # None: as the plan's backend saves (Backend.saves_async); else a what-if
    gpu_hour_price: float | None = None

    @property
    def recovery_s(self) -> float:
        """R before the reload: the measured --restart-s, else the restart mode's default."""
        return RESTART_MODES[self.restart] if self.restart_s is None else self.restart_s


def training_time(tokens: int, step_time_s: float, tokens_per_step: int, gpus: int) -> dict:
    """{tokens, steps, days, gpu_hours}: whole optimizer steps (the last one full) at the predicted step time."""
    steps = -(-tokens // tokens_per_step)
    seconds = steps * step_time_s
    return {"tokens": tokens, "steps": steps, "days": seconds / SECONDS_PER_DAY,
            "gpu_hours": seconds * gpus / SECONDS_PER_HOUR}


def checkpoint_interval_steps(cost: CheckpointCost, step_time_s: float, mtbf_s: float, steps: int) -> int:
    """Daly's optimum interval in whole steps (at least 1, at most the run). An asynchronous save must be complete
    before the next one starts (one in flight at a time), so its interval is at least its write time."""
    interval = daly_interval_s(cost.blocking_s, mtbf_s)
    if cost.async_save:
        interval = max(interval, cost.write_s)
    if math.isinf(interval):
        return steps
    return min(steps, max(1, round(interval / step_time_s)))


def record_training_time(record: Prediction, tokens: int, inputs: FailureInputs = FailureInputs()) -> dict:
    """The training_time of one prediction (`dmt estimate`, a plan of `dmt plan`)."""
    return expected_training_time(tokens, record.plan, record.step_time_s, record.params.trainable,
                                  record.memory_bytes.weights + record.memory_bytes.optimizer,
                                  get_gpu(record.gpu).pcie_bw_gbps, inputs)


def expected_training_time(tokens: int, plan: Plan, step_time_s: float, trained_params: int, local_bytes: int,
                           host_link_gbps: float, inputs: FailureInputs = FailureInputs()) -> dict:
    """Failure-free, and expected with the plan's checkpoints and the failures `inputs` assume; `local_bytes` the
    busiest GPU's weights and optimizer states (the memory estimate's)."""
    base = training_time(tokens, step_time_s, plan.global_batch * plan.seq_len, plan.gpus)
    async_save = backend_of(plan).saves_async(None) if inputs.async_save is None else inputs.async_save
    cost = checkpoint_cost(trained_params, plan, local_bytes, host_link_gbps, async_save,
                           inputs.write_bw_gbps_per_node, inputs.write_s, inputs.local_checkpoint)
    mtbf = mean_time_between_failures_s(inputs.failure_rate_per_gpu_hour, plan.gpus)
    interval_steps = checkpoint_interval_steps(cost, step_time_s, mtbf, base["steps"])
    interval_s = interval_steps * step_time_s
    run = run_with_failures(base["steps"] * step_time_s, interval_s, cost.blocking_s, inputs.recovery_s,
                            cost.reload_s, mtbf, unsaved_s=cost.write_s if cost.async_save else 0.0)
    gpu_hours = run.wall_s * plan.gpus / SECONDS_PER_HOUR
    return {
        "tokens": tokens, "steps": base["steps"],
        "days_compute": base["days"], "gpu_hours_compute": base["gpu_hours"],
        "days": run.wall_s / SECONDS_PER_DAY, "gpu_hours": gpu_hours,
        "interruptions": run.interruptions, "goodput": run.goodput,
        "mtbf_h": None if math.isinf(mtbf) else mtbf / SECONDS_PER_HOUR,
        "failure_rate_per_gpu_hour": inputs.failure_rate_per_gpu_hour, "restart": inputs.restart,
        "restart_s": inputs.recovery_s,
        "lost_h": {"checkpoints": run.checkpoints_s / SECONDS_PER_HOUR, "restarts": run.restarts_s / SECONDS_PER_HOUR,
                   "reloads": run.reloads_s / SECONDS_PER_HOUR, "recomputed": run.recomputed_s / SECONDS_PER_HOUR},
        "checkpoint": {"bytes": cost.bytes, "write_s": cost.write_s, "blocking_s": cost.blocking_s,
                       "interval_s": interval_s, "interval_steps": interval_steps, "async_save": cost.async_save,
                       "local_bytes": cost.local_bytes, "reload_s": cost.reload_s,
                       "local": inputs.local_checkpoint,
                       "write_bw_gbps_per_node": None if inputs.write_s is not None else inputs.write_bw_gbps_per_node},
        "cost": None if inputs.gpu_hour_price is None else gpu_hours * inputs.gpu_hour_price,
    }
