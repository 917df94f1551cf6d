"""`dmt calibrate RUN_DIR ... --out calibration.yaml`: fit the step-time model's free parameters to measured runs."""

from __future__ import annotations

import argparse

from toolkit.cli.common import host_peak_text, measured_links
from toolkit.cli.console import console as make_console
from toolkit.cli.paths import output_arg, path_arg
from toolkit.errors import UserInputError
from toolkit.estimate.calibrate import fit_calibration
from toolkit.numeric import bounded_int, json_text, yaml_text
from toolkit.outputs import output_file, write_file
from toolkit.report.runs import DEFAULT_WARMUP, calibration_runs, read_run
from toolkit.spec.calibration import MeasuredLinks
from toolkit.spec.cluster import get_gpu

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
    warmup = DEFAULT_WARMUP if args.warmup is None else args.warmup
    if warmup < 0:
        raise UserInputError("--warmup", f"must be 0 or more, got {warmup}")
    out = output_file(args.out, "--out")  # never over --health, a run directory or a file in one
    links = _links(args.health)
    runs, hardware = calibration_runs([read_run(path, warmup) for path in args.run_dirs], warmup)
    calibration = fit_calibration(runs, get_gpu(hardware), links, warmup)
    data = calibration.model_dump(mode="json")
    write_file(out, HEADER + yaml_text(data, sort_keys=False), "--out")
    if args.json:
        print(json_text({**data, "file": str(out)}, indent=2))
        return 0
    _print(calibration, out)
    return 0


def _links(health):
    if health is None:
        return None

    measured = measured_links(health, "--health")
    if not measured:
        raise UserInputError("--health", f"{health} measured no link (one rank per node and one node?); calibrate "
                                         f"without --health")
    return MeasuredLinks(intra_node_busbw_gbps=measured.get("intra"), inter_node_busbw_gbps=measured.get("inter"),
                         source=str(health))


def _print(calibration, out) -> None:
    from rich.table import Table

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
        console.print(f"{host_peak_text(calibration.describe())} (kept in the file; every prediction with it uses this "
                      f"peak)")
    if calibration.links is not None:
        console.print(f"measured links from {calibration.links.source}: intra-node "
                      f"{calibration.links.intra_node_busbw_gbps} GB/s, inter-node "
                      f"{calibration.links.inter_node_busbw_gbps} GB/s")
    console.print(f"written to {out}")
