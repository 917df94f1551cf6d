"""Fitting the step-time model's free parameters to measured runs: each execution path's compute scale and fixed
per-step cost.

For every execution path (toolkit/estimate/efficiency.py EXECUTION_PATHS) seen in the runs, two numbers are fitted
where the runs can tell them apart: its compute_scale, the rate of its GEMMs and the work between them against the
fused-kernel curve (the curve's shape in width and tokens is kept), and its fixed_step_s, what every step costs
whatever its size (the Trainer's and the engine's per-step work, logging, the data loader, synchronisation). One
scale alone cannot fit two runs whose steps are dominated by different things: on a small model the fixed cost is
comparable to the compute, so doubling the micro-batch does not double the step time. The pair minimises the squared
log ratio of predicted to measured step time over that path's runs (least squares in log space, so a run 2x too slow
and one 2x too fast weigh alike); with one run only the scale is fitted (the fixed cost stays 0) and the calibration
says so. Everything else the prediction uses is held at what the calibration states (the host peak, measured links)
or the catalogue's. The fit is pure arithmetic: runs come in as (model, plan, measured time).

`fit_calibration` is what `dmt calibrate` runs: the fit of finished runs (MeasuredRun, read back from their run
directories by toolkit/report/runs.py) and, on the host entry, its matmul peak measured again, assembled into the
Calibration the file holds, with every run's error before and after and each path's residuals.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from toolkit.estimate.comm import Network
from toolkit.estimate.device_peak import host_cores, host_matmul_tflops
from toolkit.estimate.efficiency import (
    EXECUTION_PATHS,
    HOST_GEMM_CEILING,
    effective_width,
    execution_path,
    gemm_efficiency,
)
from toolkit.estimate.timing import step_time
from toolkit.spec.calibration import (
    FORMAT,
    Calibration,
    FittedRun,
    HostPeak,
    MeasuredLinks,
    PathEfficiency,
    Residuals,
)
from toolkit.spec.cluster import GPU, peak_key
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import Plan

# the search interval of a compute scale starts far below any real run; it ends where every run's GEMM efficiency
# reaches the peak (step_time caps it there, so a larger scale changes nothing). A scale above 1 says the curve's
# shape, not the execution path's rate, is what misses these runs; calibrate says so.
LOWEST = 1e-4
GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass(frozen=True)
class Observation:
    """One measured run: its model, its plan, and the median step time measured after the warm-up."""

    model: ModelSpec
    plan: Plan
    measured_step_time_s: float


@dataclass(frozen=True)
class PathFit:
    """What was fitted for one execution path."""

    compute_scale: float
    fixed_step_s: float = 0.0
    runs: int = 1
    with_fixed_cost: bool = False  # whether the fixed per-step cost was fitted (else it is 0 by assumption)
    widest: float | None = None  # host fits: the effective GEMM width of the widest run (ExecutionPath.fitted_width)

    @property
    def fitted(self) -> str:
        return "compute_scale+fixed_step" if self.with_fixed_cost else "compute_scale"


@dataclass(frozen=True)
class MeasuredRun:
    """A finished run as its calibration records it: the observation, where it came from, and what its launch
    recorded of the host (run_plan.json)."""

    observation: Observation
    run_dir: str
    plan_label: str  # the run's plan as dmt plan labels it
    steps: int  # logged steps after the warm-up, whose median step time the observation holds
    threads_per_rank: int | None = None  # launch.threads_per_rank: the threads each rank computed with
    rank_peak_tflops: float | None = None  # the peak its prediction used: on the host, a rank's share at launch


def provisional(hardware: str, efficiency: dict[str, float | PathFit], host_peak_tflops: dict[str, float] | None,
                links) -> Calibration:
    """A calibration with only the fitted figures (no runs or residuals yet): what step_time needs during the fit.
    `efficiency`: per path, a PathFit or a bare compute scale (no fixed cost)."""
    fits = {path: value if isinstance(value, PathFit) else PathFit(value) for path, value in efficiency.items()}
    fitted = {path: PathEfficiency.model_construct(compute_scale=fit.compute_scale, fixed_step_s=fit.fixed_step_s,
                                                   fitted=fit.fitted, uncalibrated=EXECUTION_PATHS[path].compute_scale,
                                                   runs=fit.runs, fitted_width=fit.widest)
              for path, fit in fits.items()}
    return Calibration.model_construct(format=FORMAT, hardware=hardware, efficiency=fitted,
                                       host_peak_tflops=host_peak_tflops, links=links)


def predicted_step_time(observation: Observation, gpu: GPU, calibration: Calibration | None) -> float:
    network = Network.from_catalogue(gpu, observation.plan.gpus_per_node)
    return step_time(observation.model, observation.plan, gpu, network, calibration=calibration).total_s


def path_of(plan: Plan) -> str:
    return execution_path(plan).name


def _ceiling(runs: list[Observation]) -> float:
    """The scale from which on every run computes at the peak (the largest 1 / curve among them)."""
    return max(1.0 / gemm_efficiency(o.model.hidden_size, o.plan.tp, o.plan.micro_batch * o.plan.seq_len // o.plan.cp)
               for o in runs)


# where the search for a path's compute scale stops: log(scale) known to this.
LOG_SCALE_TOLERANCE = 1e-7
# What the fit guarantees on the runs it saw, whatever their step times: their errors straddle 0, none all of one sign
# by more than this. At the least-squares optimum a positively weighted sum of the log errors is 0 (a larger scale
# shortens every prediction, so were all of one sign a nearer scale would fit better); stopping LOG_SCALE_TOLERANCE
# from it moves each log error by at most that times the share of the step the scale acts on (at most 1); 10x for the
# nested search of the fixed cost and rounding. Two runs and two free figures, where a fixed cost of 0 or more fits
# both, leave no error beyond it at all. tests/unit/test_calibration.py and tests/training/test_report_calibrate.py
# hold fits to it.
STRADDLE = 10 * LOG_SCALE_TOLERANCE
# each parameter is searched on a coarse grid first (the loss need not be unimodal: once some runs' GEMMs reach the
# peak, a larger scale changes only the others), then by golden-section search between the best point's neighbours
GRID_POINTS = 48


def minimise(loss, low: float, high: float, tolerance: float) -> tuple[float, float]:
    """(argument, value) of the smallest loss found on [low, high]: the best of a grid, refined by golden-section
    search between its neighbours."""
    grid = [low + (high - low) * i / (GRID_POINTS - 1) for i in range(GRID_POINTS)]
    losses = [loss(x) for x in grid]
    best = min(range(GRID_POINTS), key=losses.__getitem__)
    low, high = grid[max(0, best - 1)], grid[min(GRID_POINTS - 1, best + 1)]
    a, b = high - GOLDEN * (high - low), low + GOLDEN * (high - low)
    loss_a, loss_b = loss(a), loss(b)
    while high - low > tolerance:
        if loss_a <= loss_b:
            high, b, loss_b = b, a, loss_a
            a = high - GOLDEN * (high - low)
            loss_a = loss(a)
        else:
            low, a, loss_a = a, b, loss_b
            b = low + GOLDEN * (high - low)
            loss_b = loss(b)
    middle = (low + high) / 2
    return min([(grid[best], losses[best]), (middle, loss(middle))], key=lambda point: point[1])


def best_fixed_cost(variable_s: list[float], measured_s: list[float]) -> tuple[float, float]:
    """(fixed cost c >= 0, loss) minimising sum (log((t + c) / m))^2 over runs whose size-dependent predicted times are
    `variable_s` and measured times `measured_s`; c stays below the longest measured step."""
    def loss(c: float) -> float:
        return sum(math.log((t + c) / m) ** 2 for t, m in zip(variable_s, measured_s))

    return minimise(loss, 0.0, max(measured_s), max(measured_s) * 1e-9)


def fit_paths(observations: list[Observation], gpu: GPU, host_peak_tflops: dict[str, float] | None = None,
              links=None, fixed_cost: bool = True, lowest: float = LOWEST) -> dict[str, PathFit]:
    """The fitted compute scale (and, from two runs on, fixed per-step cost) of every execution path among the
    observations, one path at a time: a run belongs to one path, so the paths do not interact. `fixed_cost=False`
    fits the scale alone whatever the runs (what benchmarks/calibration_cpu.py compares the two-term fit with)."""
    by_path: dict[str, list[Observation]] = defaultdict(list)
    for observation in observations:
        by_path[path_of(observation.plan)].append(observation)
    fitted: dict[str, PathFit] = {}
    for path, runs in sorted(by_path.items()):
        measured = [o.measured_step_time_s for o in runs]
        with_fixed = fixed_cost and len(runs) > 1

        def fit_at(log_scale: float) -> tuple[float, float]:
            """(fixed cost, loss) at this scale: the runs' predictions without a fixed cost, then the best one."""
            trial = provisional(gpu.name, {**fitted, path: math.exp(log_scale)}, host_peak_tflops, links)
            variable = [predicted_step_time(o, gpu, trial) for o in runs]
            if with_fixed:
                return best_fixed_cost(variable, measured)
            return 0.0, sum(math.log(t / m) ** 2 for t, m in zip(variable, measured))

        log_scale, _ = minimise(lambda x: fit_at(x)[1], math.log(lowest), math.log(_ceiling(runs)),
                                LOG_SCALE_TOLERANCE)
        fitted[path] = PathFit(math.exp(log_scale), fit_at(log_scale)[0], len(runs), with_fixed)
    return fitted


def fit_compute_scales(observations: list[Observation], gpu: GPU, host_peak_tflops: dict[str, float] | None = None,
                       links=None) -> dict[str, float]:
    """The fitted compute scale of every execution path among the observations (see fit_paths)."""
    return {path: fit.compute_scale for path, fit in fit_paths(observations, gpu, host_peak_tflops, links).items()}


# A host's measured matmul peak is only as good as the moment it was taken: measured while other work shared the
# cores it is low, and step_time's cap (no GEMM above the peak) would then hold the fitted rate below what the runs
# did, whatever the scale (the fit then leans on the cap: two micro-batch sizes at the peak predict one step time).
# The host fit therefore runs at this many times the measured peak, where no run is capped, and the peak is raised
# afterwards where the runs' GEMMs, at any micro-batch size, would reach more than HOST_GEMM_CEILING of the
# measurement: to what they reach over HOST_GEMM_CEILING (the scales move down by the same factor, so every fitted
# prediction is unchanged and none is capped).
HOST_PEAK_HEADROOM = 1e3


def fit_host_paths(observations: list[Observation], gpu: GPU, host_peak_tflops: dict[str, float], links=None,
                   fixed_cost: bool = True) -> tuple[dict[str, PathFit], dict[str, float], float]:
    """(fits, host peak, the factor the measured peak was raised by, >= 1) for runs on the host entry (see
    HOST_PEAK_HEADROOM); each path's fit holds the effective width of its widest run (PathFit.widest)."""
    boosted = {key: value * HOST_PEAK_HEADROOM for key, value in host_peak_tflops.items()}
    fits = fit_paths(observations, gpu, boosted, links, fixed_cost, lowest=LOWEST / HOST_PEAK_HEADROOM)
    # at the runs' widths with the curve's token term saturated: a plan with longer micro-batches than the runs' (the
    # held-out micro-batch 8 of the benchmark) must not pass the ceiling the raised peak sets either
    fastest = max(gemm_efficiency(o.model.hidden_size, o.plan.tp, math.inf) * fits[path_of(o.plan)].compute_scale
                  for o in observations)
    raised = max(1.0, HOST_PEAK_HEADROOM * fastest / HOST_GEMM_CEILING)
    widest = {path: max(effective_width(o.model.hidden_size, o.plan.tp) for o in observations
                        if path_of(o.plan) == path) for path in fits}
    fits = {path: PathFit(fit.compute_scale * HOST_PEAK_HEADROOM / raised, fit.fixed_step_s, fit.runs,
                          fit.with_fixed_cost, widest[path]) for path, fit in fits.items()}
    return fits, {key: value * raised for key, value in host_peak_tflops.items()}, raised


def measured_host_peak(runs: list[MeasuredRun]) -> tuple[dict[str, float], HostPeak]:
    """The host entry's peak for the fit, per precision key, and how it was measured (HostPeak): this host's matmuls
    now, at the thread count the runs' ranks computed with together (ranks per node x threads per rank, at most the
    cores), against the best each run measured at its launch. The higher stands: a peak is what the host reaches,
    and one measured while other work shared the cores would cap the fitted rate below what the runs did."""
    import os

    cores = host_cores()
    threads = min(cores, max(run.observation.plan.gpus_per_node * (run.threads_per_rank or cores) for run in runs))
    launched: dict[str, float] = {}
    for run in runs:
        plan = run.observation.plan
        key = peak_key(plan.precision)
        if run.rank_peak_tflops:  # a rank's share of the host: the host's rate is gpus_per_node x it
            launched[key] = max(launched.get(key, 0.0), run.rank_peak_tflops * plan.gpus_per_node)
        launched.setdefault(key, 0.0)
    measured = {key: host_matmul_tflops(key, threads) for key in launched}
    peak = {key: max(measured[key], launched[key]) for key in launched}
    return peak, HostPeak(threads=threads, cores=cores, load_average=round(os.getloadavg()[0], 2),
                          measured_tflops=measured, runs_tflops={k: v for k, v in launched.items() if v})


def _machine() -> dict[str, str]:
    """Where a calibration was fitted: the host's name, Python's and torch's versions."""
    import platform

    machine = {"host": platform.node(), "python": platform.python_version()}
    try:
        import torch
    except ImportError:
        return machine
    return {**machine, "torch": torch.__version__}


def fit_calibration(runs: list[MeasuredRun], gpu: GPU, links: MeasuredLinks | None, warmup: int) -> Calibration:
    """The calibration of finished runs on one hardware (`gpu`, the entry they trained on): each path's fit (on the
    host entry with its peak measured again, measured_host_peak), every run's prediction before and after it, and
    each path's residuals; stamped with when and where it was fitted."""
    from datetime import datetime, timezone

    observations = [run.observation for run in runs]
    if gpu.host:
        measured, how = measured_host_peak(runs)
        fitted, host_peak, raised = fit_host_paths(observations, gpu, measured, links)
        how = how.model_copy(update={"raised_by": raised})
    else:
        host_peak = how = None
        fitted = fit_paths(observations, gpu, None, links)
    before = provisional(gpu.name, {}, host_peak, None)  # the published model at the same host peak
    after = provisional(gpu.name, fitted, host_peak, links)
    fitted_runs = []
    for run in runs:
        predicted_before = predicted_step_time(run.observation, gpu, before)
        predicted_after = predicted_step_time(run.observation, gpu, after)
        measured = run.observation.measured_step_time_s
        fitted_runs.append(FittedRun(run_dir=run.run_dir, execution_path=path_of(run.observation.plan),
                                     plan=run.plan_label, steps=run.steps, measured_step_time_s=measured,
                                     predicted_step_time_s_before=predicted_before,
                                     predicted_step_time_s_after=predicted_after,
                                     error_before=predicted_before / measured - 1,
                                     error_after=predicted_after / measured - 1))
    residuals = {}
    for path in fitted:
        errors = [run.error_after for run in fitted_runs if run.execution_path == path]
        residuals[path] = Residuals(runs=len(errors), rms_error=math.sqrt(sum(e * e for e in errors) / len(errors)),
                                    max_abs_error=max(abs(e) for e in errors))
    efficiency = {path: PathEfficiency(compute_scale=fit.compute_scale, fixed_step_s=fit.fixed_step_s,
                                       fitted=fit.fitted, uncalibrated=EXECUTION_PATHS[path].compute_scale,
                                       runs=fit.runs, fitted_width=fit.widest) for path, fit in fitted.items()}
    return Calibration(format=FORMAT, hardware=gpu.name, efficiency=efficiency, host_peak_tflops=host_peak,
                       host_peak=how, links=links, warmup_steps=warmup, runs=fitted_runs, residuals=residuals,
                       created=datetime.now(timezone.utc).isoformat(timespec="seconds"), machine=_machine())
