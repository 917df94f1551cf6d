"""`dmt report RUN_DIR [RUN_DIR ...]`: what each training run achieved against what was predicted for it."""

from __future__ import annotations

import argparse
from pathlib import Path

from toolkit.cli.common import add_calibration_argument, calibration_line
from toolkit.cli.console import console as make_console
from toolkit.cli.paths import output_arg, path_arg
from toolkit.errors import UserInputError
from toolkit.estimate.device_peak import HOST_MATMUL_SIZE
from toolkit.numeric import GiB, bounded_int, json_text
from toolkit.outputs import output_file
from toolkit.planner.predict import plan_label
from toolkit.report.breakdown import LABELS, read_breakdown, spread_sentence
from toolkit.report.plot import write_report_plot
from toolkit.report.records import read_metrics_records, read_run_plan
from toolkit.report.runs import DEFAULT_WARMUP, read_run, repredict
from toolkit.spec.calibration import load_calibration
from toolkit.spec.cluster import get_gpu
from toolkit.spec.plan import Plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", type=path_arg, nargs="+", metavar="RUN_DIR",
                        help="training output directories (toolkit/train.py --output-dir; `dmt generate` DIR/run)")
    parser.add_argument("--warmup", type=bounded_int, default=None, metavar="N",
                        help="logged steps left out of the medians (allocation, compilation; default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object: {runs: [...]}")
    parser.add_argument("--plot", type=output_arg, default=None, metavar="FILE.png",
                        help="loss, grad norm, tokens/s and memory over the steps, with the predicted lines, and for runs "
                             "with profiled steps the predicted and measured bars per term")
    parser.add_argument("--breakdown", action="store_true",
                        help="the profiled steps (train.py --profile-steps, training.profile) per step and rank: "
                             "compute, communication, data wait, optimizer, checkpoint pause and idle beside the "
                             "predicted terms, the largest gap and the slowest rank")
    add_calibration_argument(parser, "re-predict every run")


def run(args: argparse.Namespace) -> int:
    warmup = DEFAULT_WARMUP if args.warmup is None else args.warmup
    if warmup < 0:
        raise UserInputError("--warmup", f"must be 0 or more, got {warmup}")
    if args.plot is not None:
        args.plot = output_file(args.plot, "--plot", suffix=".png")  # not over a run's file, nor --calibration
    calibration = None
    if args.calibration is not None:
        calibration = load_calibration(args.calibration)
    reports = [read_run(path, warmup) for path in args.run_dirs]
    for report in reports:
        if calibration is not None:
            repredict(report, calibration)
    if args.breakdown or args.plot is not None:  # the plot draws the profiled runs' bars
        for report in reports:
            report.breakdown = read_breakdown(Path(report.run_dir), _predicted_terms(Path(report.run_dir)))
    if args.plot is not None:
        write_report_plot(args.plot, [(report, read_metrics_records(report.run_dir)[0]) for report in reports])
    if args.json:
        print(json_text({"warmup_steps": warmup, "runs": [report.as_dict() for report in reports]}, indent=2))
        return 0
    _print_table(reports, warmup)
    if args.breakdown:
        for report in reports:
            _print_breakdown(report)
    if args.plot is not None:
        print(f"plot written to {args.plot}")
    return 0


def _predicted_terms(run_dir: Path) -> dict | None:
    """The estimator's terms of the run's plan, as its launch predicted them (run_plan.json)."""
    record, _ = read_run_plan(run_dir)
    terms = (record or {}).get("step_time_breakdown_s")
    return terms if isinstance(terms, dict) else None


def _print_breakdown(report) -> None:
    from rich.table import Table

    console = make_console()
    breakdown = report.breakdown
    if breakdown is None:
        console.print(f"{report.run_dir}: no profiled steps (train with --profile-steps A-B or training.profile)")
        return
    terms = ("step_s", "compute_s", "communication_exposed_s", "communication_overlapped_s", "data_wait_s",
             "optimizer_s", "checkpoint_s", "idle_s")
    table = Table(title=f"{report.run_dir}: where the time went, seconds ({breakdown['source']})",
                  title_justify="left")
    for column in ("step", "rank", "step s", "compute", "comm exposed", "comm overlapped", "data wait", "optimizer",
                   "checkpoint", "idle"):
        table.add_column(column, justify="right")
    for row in breakdown["steps"]:
        table.add_row(str(row["step"]), str(row["rank"]), *(_number(row.get(term), ".3g") for term in terms))
    table.add_row("measured", "all", *(_number(breakdown["measured"].get(term), ".3g") for term in terms))
    predicted = breakdown["predicted"]
    if predicted is not None:
        table.add_row("predicted", "-", "-", *("-" if term not in predicted else
                                              ("not modelled" if predicted[term] is None else
                                               _number(predicted[term], ".3g")) for term in terms[1:]))
    console.print(table)
    terms_predicted = breakdown.get("predicted_terms")
    if terms_predicted:
        estimator = Table(title=f"{report.run_dir}: the estimator's terms (those it predicts above 0) beside the "
                                f"measured term each is part of (the profile does not split communication by parallel "
                                f"dimension, nor idle into bubble and fixed cost)", title_justify="left")
        for column in ("estimator term", "predicted s", "measured as", "measured s"):
            estimator.add_column(column, justify="right")
        for entry in (entry for entry in terms_predicted.values() if entry["predicted_s"] > 0):
            estimator.add_row(entry["label"], _number(entry["predicted_s"], ".3g"), LABELS[entry["measured_as"]],
                              _number(breakdown["measured"][entry["measured_as"]], ".3g"))
        console.print(estimator)
    for line in (breakdown["gap"], spread_sentence(breakdown["stragglers"]), breakdown["stragglers"]["sentence"]):
        if line:
            console.print(f"{report.run_dir}: {line}")


def _number(value, form: str) -> str:
    return "-" if value is None else format(value, form)


def _with_error(value, form: str, error=None, unit: str = "") -> str:
    return _number(value, form) + unit + (f" ({error:+.0%})" if error is not None else "")


def _pair(measured, predicted, form: str, error=None) -> str:
    return f"{_number(measured, form)} / {_with_error(predicted, form, error)}"


def _checkpoints(summary: dict) -> str:
    """count x median pause / median time to complete (the share of the run spent paused)."""
    if not summary["count"]:
        return "-"
    return (f"{summary['count']} x {_number(summary['blocking_s'], '.3g')} / {_number(summary['persist_s'], '.3g')} "
            f"({_number(summary['stall_fraction'], '.1%')})")


def _print_table(reports, warmup: int) -> None:
    from rich.table import Table

    console = make_console()
    table = Table(title=f"measured / predicted (medians after {warmup} warm-up records; error = predicted / "
                        f"measured - 1)", title_justify="left")
    for column in ("run", "plan", "status", "steps", "step s", "tokens/s", "MFU", "GiB (allocator)", "data wait s",
                   "checkpoints: paused / complete s (run paused)"):
        table.add_column(column, justify="left" if column in ("run", "plan", "status") else "right")
    for r in reports:
        m, p = r.measured, r.predicted
        label = plan_label(Plan.model_validate(r.plan)) if r.plan else "-"
        gib = [None if v is None else v / GiB for v in (m["peak_allocated_bytes"], p["allocated_bytes"])]
        memory = _pair(*gib, ".2f", r.error["memory"]) if gib[0] is not None else \
            f"not measured / {_number(gib[1], '.2f')}"
        table.add_row(r.run_dir, label, r.status if r.reason is None or r.status == "completed" else
                      f"{r.status}: {r.reason}", str(r.steps),
                      _pair(m["step_time_s"], p["step_time_s"], ".3g", r.error["step_time"]),
                      _pair(m["tokens_per_s"], p["tokens_per_s"], ",.0f"),
                      _pair(m["mfu"], p["mfu"], ".1%"),
                      memory,
                      _number(m["data_wait_s"], ".3g"), _checkpoints(r.checkpoints))
    console.print(table)
    for r in reports:
        notes = [calibration_line(r.calibration)]
        if r.status == "completed" and r.reason:
            notes.append(r.reason)
        if r.measured["mfu"] is None and r.status == "completed":
            notes.append("MFU not measured: the device that ran has no catalogue peak (a CPU run of a GPU recipe)")
        if r.measured["mfu"] is not None and r.measured["mfu"] > 1 and _mfu_above_peak(r):
            notes.append(_mfu_above_peak(r))
        console.print(f"{r.run_dir}: " + "; ".join(notes))
        if r.moe is not None:
            console.print(f"{r.run_dir}: {_moe_line(r.moe)}")
        if r.launch_prediction is not None:
            console.print(f"{r.run_dir}: {_against_launch(r)}")


def _mfu_above_peak(r) -> str | None:
    """Why a measured MFU reads above 100% on the host entry (a datasheet peak beaten is damage, runs.py): the run's
    GEMMs outran the matmul probe the uncalibrated peak is."""
    if r.gpu is None or not get_gpu(r.gpu).host or r.calibration:
        return None
    return (f"MFU above 100%: the uncalibrated `{r.gpu}` peak is this host's {HOST_MATMUL_SIZE}x{HOST_MATMUL_SIZE} "
            f"matmul rate, which a narrow model's small GEMMs can beat on a CPU; dmt calibrate raises it to what the "
            f"run reached")


def _against_launch(r) -> str:
    """One line: how close the re-prediction came, beside what the run's launch predicted (dmt report --calibration)."""
    launch = r.launch_prediction
    how = "uncalibrated" if not launch["calibration"] else f"calibrated by {launch['calibration']['file']}"
    measured = r.measured["step_time_s"]
    head = "step time predicted " if measured is None else f"step time {measured:.3g} s measured; predicted "
    return (f"{head}{_with_error(r.predicted['step_time_s'], '.3g', r.error['step_time'], ' s')} with the calibration, "
            f"{_with_error(launch['step_time_s'], '.3g', launch['step_time_error'], ' s')} at its launch ({how}, "
            f"run_plan.json)")


def _moe_line(moe: dict) -> str:
    """One line: the routing imbalance the run saw against the one its plan assumed (--moe-imbalance)."""
    seen = (f"MoE imbalance (busiest expert-parallel rank's routed tokens / mean) median {moe['imbalance_median']:.3g}, "
            f"max {moe['imbalance_max']:.3g} over {moe['steps']} steps")
    if moe["planned_imbalance"] is None:
        return f"{seen}; the plan states none"
    verdict = ("above it: the busiest expert rank's memory and time were planned too low" if moe["above_plan"]
               else "within it")
    return f"{seen}; the plan assumed {moe['planned_imbalance']:.3g} (--moe-imbalance): {verdict}"
