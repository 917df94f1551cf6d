"""Failures and checkpoints over a whole run: Daly's optimum checkpoint interval and the expected wall-clock time.

Failures arrive as a Poisson process (Daly's model): a job on G GPUs at a rate of λ failures per GPU-hour sees one
every M = 1 / (λ G) hours on average. A run needs T_s seconds of failure-free compute; it blocks δ seconds at every
checkpoint, one every τ seconds of compute; after a failure it loses R seconds before it computes again (restart,
reload) plus the work done since its last complete checkpoint.

J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", Future Generation
Computer Systems 22 (2006) 303-312, doi:10.1016/j.future.2004.11.016:
- the optimum compute time between checkpoints (its higher-order perturbation solution)
      τ = sqrt(2 δ M) [1 + (1/3) sqrt(δ / 2M) + (1/9) (δ / 2M)] - δ    for δ < 2M,    τ = M otherwise,
  which tends to Young's first-order sqrt(2 δ M) (CACM 17(9), 1974) as δ / M -> 0;
- the expected wall-clock time of the whole run (its complete cost function: failures may strike during a
  checkpoint or a restart too)
      T_w = M e^(R/M) (e^((τ + δ)/M) - 1) T_s / τ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toolkit.errors import UserInputError

SECONDS_PER_HOUR = 3600

# Llama 3 405B pretraining: 419 unexpected interruptions in a 54-day snapshot on 16,384 H100s (arXiv:2407.21783,
# Sec. 3.3.4, "Reliability and operational challenges"): 419 / (54 x 24 x 16,384) = 1.97e-5 per GPU-hour, one
# interruption every 3.1 hours for the job. Hardware and software faults alike; planned maintenance left out.
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16_384
FAILURE_RATE_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)

# From a failure to training again, before the checkpoint is read back: detecting the fault, rescheduling the job,
# starting the processes and the communicators. No published LLM run states it; 10 minutes is the restart time of
# Daly's own worked examples (R = 10 min), an assumption to replace with a measured figure (--restart-s).
RESTART_S = 600.0
# training.restart: in_process (NVIDIA Resiliency Extension's in-process restart): no job, container, interpreter,
# import or CUDA context starts again; what is left is detecting the fault, the surviving ranks' restart barrier, new
# communicators, the model built again and the first step. NVRx's documentation names what it removes but publishes
# no time; the figure is our own measurement (benchmarks/restart_time.md: failure to the end of the next step,
# checkpoint read included, 2 CPU ranks of a tiny Megatron-Core model on a 2-core machine at load 32-40: median
# 12.1 s, where a relaunch took 102 s), rounded up. A GPU cluster's NCCL communicators take longer to form than gloo's and its
# model is larger: pass a measured one (--restart-s).
RESTART_S_IN_PROCESS = 15.0
RESTART_MODES = {"relaunch": RESTART_S, "in_process": RESTART_S_IN_PROCESS}  # training.restart -> its default R


def mean_time_between_failures_s(failure_rate_per_gpu_hour: float, gpus: int) -> float:
    """M in seconds for a job on `gpus` GPUs; infinite when no failure is expected."""
    if failure_rate_per_gpu_hour <= 0:
        return math.inf
    return SECONDS_PER_HOUR / (failure_rate_per_gpu_hour * gpus)


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints, in the units of its arguments."""
    if math.isinf(mtbf_s):
        return math.inf
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - checkpoint_s


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum sqrt(2 δ M), the limit Daly's tends to for a short checkpoint."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def expected_wall_s(compute_s: float, interval_s: float, checkpoint_s: float, restart_s: float,
                    mtbf_s: float) -> float:
    """Daly's expected wall-clock time T_w of `compute_s` of work; without failures, the compute and the
    checkpoints alone."""
    segments = compute_s / interval_s
    if math.isinf(mtbf_s):
        return compute_s + segments * checkpoint_s
    try:
        wall = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + checkpoint_s) / mtbf_s) * segments
    except OverflowError:
        wall = math.inf
    if not math.isfinite(wall):  # each restart takes longer than failures come: the run never completes
        raise UserInputError("--failure-rate", f"a failure every {mtbf_s:.3g} s, {restart_s:.3g} s to recover "
                                               f"from each and {interval_s + checkpoint_s:.3g} s from one "
                                               f"checkpoint to the next: the expected run never completes; give a "
                                               f"lower --failure-rate or --restart-s")
    return wall


@dataclass(frozen=True)
class Goodput:
    """A run's expected wall-clock time with failures and checkpoints, and where the time beyond compute went."""

    compute_s: float  # failure-free: the steps at the predicted step time
    wall_s: float  # expected, with checkpoints and failures
    interruptions: float  # expected failures during wall_s
    checkpoints_s: float  # blocked in checkpoints that completed a segment
    restarts_s: float  # from each failure to training again (restart_s each)
    reloads_s: float  # reading the last checkpoint back (reload_s each)
    recomputed_s: float  # work redone since the last complete checkpoint, and what failures cut short

    @property
    def goodput(self) -> float:
        """Useful training time over elapsed time."""
        return self.compute_s / self.wall_s if self.wall_s else 1.0


def run_with_failures(compute_s: float, interval_s: float, blocking_s: float, restart_s: float, reload_s: float,
                      mtbf_s: float, unsaved_s: float = 0.0) -> Goodput:
    """The expected run: Daly's T_w with R = restart + reload + `unsaved_s`, the work a failure loses beyond
    Daly's model. An asynchronous save is complete only `unsaved_s` (its write time) after training resumes; a
    failure in that window rolls back one interval further, which costs `unsaved_s` more per failure on average (a
    failure at x of an interval τ >= w loses x, or x + τ when x < w: τ/2 + w on average)."""
    recovery_s = restart_s + reload_s + unsaved_s
    wall = expected_wall_s(compute_s, interval_s, blocking_s, recovery_s, mtbf_s)
    interruptions = 0.0 if math.isinf(mtbf_s) else wall / mtbf_s
    checkpoints = compute_s / interval_s * blocking_s
    restarts, reloads = interruptions * restart_s, interruptions * reload_s
    recomputed = max(0.0, wall - compute_s - checkpoints - restarts - reloads)
    return Goodput(compute_s=compute_s, wall_s=wall, interruptions=interruptions, checkpoints_s=checkpoints,
                   restarts_s=restarts, reloads_s=reloads, recomputed_s=recomputed)
