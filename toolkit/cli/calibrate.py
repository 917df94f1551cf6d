"""`dmt calibrate RUN_DIR ... --out calibration.yaml`: fit the step-time model's free parameters to measured runs."""

from __future__ import annotations

import argparse

from toolkit.cli.paths import output_arg, path_arg
from toolkit.errors import UserInputError
from toolkit.numeric import bounded_int, json_text, yaml_text

HEADER = ("# Written by `dmt calibrate`: the step-time model's free parameters fitted to the runs listed below, for\n"
          "# the hardware named. Use it with `dmt estimate / plan / generate / report --calibration FILE` or a\n"
          "# recipe's cluster.calibration. The errors are signed: predicted / measured - 1.\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", type=path_arg, nargs="+", metavar="RUN_DIR",
                        help="finished training runs on one hardware (toolkit/train.py --output-dir)")
    parser.add_argument("--out", type=output_arg, required=True, metavar="CALIBRATION_YAML",
                        help="the calibration file to write")
    parser.add_argument("--health", type=path_arg, default=None, metavar="HEALTH_JSON",
                        help="a `dmt health --json` report of the same machines: its measured link bandwidths join "
                             "the calibration")
    parser.add_argument("--warmup", type=bounded_int, default=None, metavar="N",
                        help="logged steps left out of each run's median step time (default 3)")
    parser.add_argument("--json", action="store_true", help="print the calibration as one JSON object")


def run(args: argparse.Namespace) -> int:
    import platform
    from datetime import datetime, timezone

    from toolkit.outputs import output_file, write_file
    from toolkit.report.runs import DEFAULT_WARMUP, read_run

    warmup = DEFAULT_WARMUP if args.warmup is None else args.warmup
    if warmup < 0:
        raise UserInputError("--warmup", f"must be 0 or more, got {warmup}")
    out = output_file(args.out, "--out")  # never over --health, a run directory or a file in one
    links = _links(args.health)
    reports = [read_run(path, warmup) for path in args.run_dirs]
    observations, hardware, records = _observations(reports)
    calibration = _fit(observations, records, reports, hardware, links, warmup)
    calibration = calibration.model_copy(update={
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "python": platform.python_version(), **_torch_version()}})
    data = calibration.model_dump(mode="json")
    write_file(out, HEADER + yaml_text(data, sort_keys=False), "--out")
    if args.json:
        print(json_text({**data, "file": str(out)}, indent=2))
        return 0
    _print(calibration, out)
    return 0


def _torch_version() -> dict:
    try:
        import torch
    except ImportError:
        return {}
    return {"torch": torch.__version__}


def _links(health):
    if health is None:
        return None
    from toolkit.cli.common import measured_links
    from toolkit.spec.calibration import MeasuredLinks

    measured = measured_links(health, "--health")
    if not measured:
        raise UserInputError("--health", f"{health} measured no link (one rank per node and one node?); calibrate "
                                         f"without --health")
    return MeasuredLinks(intra_node_busbw_gbps=measured.get("intra"), inter_node_busbw_gbps=measured.get("inter"),
                         source=str(health))


def _observations(reports):
    """(observations, hardware, each run's record) of finished runs on one hardware; else one line."""
    from toolkit.estimate.calibrate import Observation
    from toolkit.report.runs import check_trained_on, run_subject

    observations, hardware, records = [], {}, []
    for report in reports:
        if report.status != "completed" or report.measured["step_time_s"] is None:
            raise UserInputError("RUN_DIR", f"{report.run_dir} is {report.status} ({report.reason}): only finished "
                                            f"runs with more logged steps than the warm-up calibrate")
        model, plan, gpu, record = run_subject(report.run_dir, "it trained (written by toolkit/train.py)")
        check_trained_on(report.run_dir, gpu, record)
        hardware[gpu.name] = report.run_dir
        records.append(record)
        observations.append(Observation(model, plan, report.measured["step_time_s"]))
    if len(hardware) > 1:
        named = ", ".join(f"{name} ({run})" for name, run in hardware.items())
        raise UserInputError("RUN_DIR", f"the runs trained on different hardware: {named}; a calibration is for one")
    return observations, next(iter(hardware)), records


def _host_peak(observations, records):
    """The host entry's peak for the fit, per precision key, and how it was measured (HostPeak): this host's matmuls
    now, at the thread count the runs' ranks computed with together (ranks per node x threads per rank, at most the
    cores), against the best each run measured at its launch. The higher stands: a peak is what the host reaches,
    and one measured while other work shared the cores would cap the fitted rate below what the runs did."""
    import os

    from toolkit.spec.calibration import HostPeak
    from toolkit.estimate.device_peak import host_cores, host_matmul_tflops
    from toolkit.spec.cluster import peak_key

    cores = host_cores()
    threads = min(cores, max(o.plan.gpus_per_node * int((r.get("launch") or {}).get("threads_per_rank") or cores)
                             for o, r in zip(observations, records)))
    runs: dict[str, float] = {}
    for observation, record in zip(observations, records):
        key = peak_key(observation.plan.precision)
        if record.get("peak_tflops"):  # a rank's share of the host: the host's rate is gpus_per_node x it
            runs[key] = max(runs.get(key, 0.0), record["peak_tflops"] * observation.plan.gpus_per_node)
        runs.setdefault(key, 0.0)
    measured = {key: host_matmul_tflops(key, threads) for key in runs}
    peak = {key: max(measured[key], runs[key]) for key in runs}
    return peak, HostPeak(threads=threads, cores=cores, load_average=round(os.getloadavg()[0], 2),
                          measured_tflops=measured, runs_tflops={k: v for k, v in runs.items() if v})


def _fit(observations, records, reports, hardware: str, links, warmup: int):
    import math

    from toolkit.estimate.calibrate import fit_host_paths, fit_paths, path_of, predicted_step_time, provisional
    from toolkit.estimate.efficiency import EXECUTION_PATHS
    from toolkit.planner.report import plan_label
    from toolkit.spec.calibration import (
        FORMAT,
        Calibration,
        FittedRun,
        PathEfficiency,
        Residuals,
    )
    from toolkit.spec.cluster import get_gpu

    gpu = get_gpu(hardware)
    if gpu.host:
        measured, how = _host_peak(observations, records)
        fitted, host_peak, raised = fit_host_paths(observations, gpu, measured, links)
        how = how.model_copy(update={"raised_by": raised})
    else:
        host_peak = how = None
        fitted = fit_paths(observations, gpu, None, links)
    before = provisional(hardware, {}, host_peak, None)  # the published model at the same host peak
    after = provisional(hardware, fitted, host_peak, links)
    runs = []
    for observation, report in zip(observations, reports):
        predicted_before = predicted_step_time(observation, gpu, before)
        predicted_after = predicted_step_time(observation, gpu, after)
        measured = observation.measured_step_time_s
        runs.append(FittedRun(run_dir=report.run_dir, execution_path=path_of(observation.plan),
                              plan=plan_label(observation.plan), steps=max(0, report.steps - warmup),
                              measured_step_time_s=measured, predicted_step_time_s_before=predicted_before,
                              predicted_step_time_s_after=predicted_after, error_before=predicted_before / measured - 1,
                              error_after=predicted_after / measured - 1))
    residuals = {}
    for path in fitted:
        errors = [run.error_after for run in runs if run.execution_path == path]
        residuals[path] = Residuals(runs=len(errors), rms_error=math.sqrt(sum(e * e for e in errors) / len(errors)),
                                    max_abs_error=max(abs(e) for e in errors))
    efficiency = {path: PathEfficiency(compute_scale=fit.compute_scale, fixed_step_s=fit.fixed_step_s,
                                       fitted=fit.fitted, uncalibrated=EXECUTION_PATHS[path].compute_scale,
                                       runs=fit.runs) for path, fit in fitted.items()}
    return Calibration(format=FORMAT, hardware=hardware, efficiency=efficiency, host_peak_tflops=host_peak,
                       host_peak=how, links=links, warmup_steps=warmup, runs=runs, residuals=residuals, created="",
                       machine={})


def _print(calibration, out) -> None:
    from rich.table import Table

    from toolkit.cli.console import console as make_console

    console = make_console()
    table = Table(title=f"{calibration.hardware}: step time measured / predicted before -> after calibration",
                  title_justify="left")
    for column in ("run", "plan", "path", "measured s", "before s", "after s"):
        table.add_column(column, justify="left" if column in ("run", "plan", "path") else "right")
    for r in calibration.runs:
        table.add_row(r.run_dir, r.plan, r.execution_path, f"{r.measured_step_time_s:.3g}",
                      f"{r.predicted_step_time_s_before:.3g} ({r.error_before:+.0%})",
                      f"{r.predicted_step_time_s_after:.3g} ({r.error_after:+.0%})")
    console.print(table)
    for path, value in calibration.efficiency.items():
        residual = calibration.residuals[path]
        fixed = (f", fixed {value.fixed_step_s:.3g} s per step" if value.fitted == "compute_scale+fixed_step" else
                 " (one run: the scale alone; a fixed per-step cost needs two runs or more)")
        console.print(f"{path}: compute scale {value.compute_scale:.3g} of the fused-kernel curve (published "
                      f"{value.uncalibrated:.3g}){fixed}, {residual.runs} run(s), residual rms "
                      f"{residual.rms_error:.1%}, max {residual.max_abs_error:.1%}")
        if value.compute_scale > 1:
            console.print("  above 1: this hardware runs these runs' GEMMs faster against its peak than the "
                          "fused-kernel curve allows (on a CPU host the curve's GPU shape marks narrow layers down far more than "
                          "the host does); the fit holds near these runs' model width, and no prediction exceeds the "
                          "peak")
    if calibration.host_peak_tflops:
        from toolkit.cli.common import host_peak_text

        console.print(f"{host_peak_text(calibration.describe())} (kept in the file; every prediction with it uses this "
                      f"peak)")
    if calibration.links is not None:
        console.print(f"measured links from {calibration.links.source}: intra-node "
                      f"{calibration.links.intra_node_busbw_gbps} GB/s, inter-node "
                      f"{calibration.links.inter_node_busbw_gbps} GB/s")
    console.print(f"written to {out}")
