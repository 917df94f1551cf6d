"""Fitting the step-time model's free parameters to measured runs: each execution path's compute scale.

For every execution path (toolkit/estimate/efficiency.py EXECUTION_PATHS) seen in the runs, one number is fitted:
its compute_scale, the rate of its GEMMs and the work between them against the fused-kernel curve (the curve's shape
in width and tokens is kept). It is the value minimising the squared log ratio of predicted to measured step time
over that path's runs, so a run 2x too slow and one 2x too fast weigh alike. Everything else the prediction uses is
held at what the calibration states (the host peak, measured links) or the catalogue's. Pure arithmetic: runs come in as (model, plan, measured time).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from toolkit.estimate.comm import Network
from toolkit.estimate.efficiency import EXECUTION_PATHS, execution_path, gemm_efficiency
from toolkit.estimate.timing import step_time
from toolkit.spec.calibration import FORMAT, Calibration
from toolkit.spec.cluster import GPU
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import Plan

# the search interval of a compute scale starts far below any real run; it ends where every run's GEMM efficiency
# reaches the peak (step_time caps it there, so a larger scale changes nothing). A scale above 1 says the curve's
# shape, not the path's rate, is what misses these runs; calibrate says so.
LOWEST = 1e-4
GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass(frozen=True)
class Observation:
    """One measured run: its model, its plan, and the median step time measured after the warm-up."""

    model: ModelSpec
    plan: Plan
    measured_step_time_s: float


def provisional(hardware: str, efficiency: dict[str, float], host_peak_tflops: dict[str, float] | None,
                links) -> Calibration:
    """A calibration with only the fitted figures (no runs or residuals yet): what step_time needs during the fit."""
    from toolkit.spec.calibration import PathEfficiency

    fitted = {path: PathEfficiency.model_construct(compute_scale=value,
                                                   uncalibrated=EXECUTION_PATHS[path].compute_scale, runs=1)
              for path, value in efficiency.items()}
    return Calibration.model_construct(format=FORMAT, hardware=hardware, efficiency=fitted,
                                       host_peak_tflops=host_peak_tflops, links=links)


def predicted_step_time(observation: Observation, gpu: GPU, calibration: Calibration | None) -> float:
    network = Network.from_catalogue(gpu, observation.plan.gpus_per_node)
    return step_time(observation.model, observation.plan, gpu, network, calibration=calibration).total_s


def _log_error(observations: list[Observation], gpu: GPU, trial: Calibration) -> float:
    return sum(math.log(predicted_step_time(o, gpu, trial) / o.measured_step_time_s) ** 2 for o in observations)


def path_of(plan: Plan) -> str:
    return execution_path(plan.backend, plan.transformer_impl).name


def _ceiling(runs: list[Observation]) -> float:
    """The scale from which on every run computes at the peak (the largest 1 / curve among them)."""
    return max(1.0 / gemm_efficiency(o.model.hidden_size, o.plan.tp, o.plan.micro_batch * o.plan.seq_len // o.plan.cp)
               for o in runs)


def fit_compute_scales(observations: list[Observation], gpu: GPU, host_peak_tflops: dict[str, float] | None = None,
                       links=None) -> dict[str, float]:
    """The fitted compute scale of every execution path among the observations (golden-section search on its log,
    one path at a time: a run belongs to one path, so the paths do not interact)."""
    by_path: dict[str, list[Observation]] = defaultdict(list)
    for observation in observations:
        by_path[path_of(observation.plan)].append(observation)
    fitted: dict[str, float] = {}
    for path, runs in sorted(by_path.items()):
        def loss(log_value: float) -> float:
            trial = provisional(gpu.name, {**fitted, path: math.exp(log_value)}, host_peak_tflops, links)
            return _log_error(runs, gpu, trial)

        low, high = math.log(LOWEST), math.log(_ceiling(runs))
        a, b = high - GOLDEN * (high - low), low + GOLDEN * (high - low)
        loss_a, loss_b = loss(a), loss(b)
        while high - low > 1e-6:
            if loss_a <= loss_b:
                high, b, loss_b = b, a, loss_a
                a = high - GOLDEN * (high - low)
                loss_a = loss(a)
            else:
                low, a, loss_a = a, b, loss_b
                b = low + GOLDEN * (high - low)
                loss_b = loss(b)
        fitted[path] = math.exp((low + high) / 2)
    return fitted
