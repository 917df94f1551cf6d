"""The calibration loop on this machine's CPU: the tiny recipe on the host catalogue entry (`cluster.gpu: cpu`, its
peak a matmul measured here), trained for real on 2 CPU ranks (gloo) at several plans, then `dmt calibrate` on the
runs at micro-batch 2 and 4 of each execution path, and every run re-predicted with that calibration (`dmt report
--calibration`). Writes a markdown table: measured step time (median after the warm-up), the published model's
prediction (uncalibrated, at the calibration's host peak), the prediction with the compute scale alone fitted (the
fit before issue 30), and with the compute scale and a fixed per-step cost fitted (`dmt calibrate` now), with their
signed errors; then each run predicted by calibrations fitted on all the *other* runs of its execution path
(leave-one-out), both ways; then the demo's loop (scripts/demo.sh): a calibration fitted on one run, the other runs
of its execution path and a second launch of that run's plan predicted with it, beside each launch's own
uncalibrated prediction. Whether a calibration brings a prediction closer is measured here, on stated runs of a
stated machine, not asserted in the test suite: the step times are the machine's, and an uncalibrated prediction can
land close by chance.

Usage: python benchmarks/calibration_cpu.py --work /tmp/calibration_cpu --out benchmarks/calibration_cpu.md
Not part of `make test`: 10 launches of about 40 s each on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-llama-cpu.yaml"
TINY_MEGATRON = REPO / "recipes" / "tiny-llama-megatron-cpu.yaml"
WARMUP = 3
# name -> (recipe, train.py flags, used to calibrate)
CASES = {
    "ds-z2-mb2": (TINY, ["--micro-batch", "2"], True),
    "ds-z2-mb4": (TINY, ["--micro-batch", "4"], True),
    "ds-z2-mb4-again": (TINY, ["--micro-batch", "4"], False),  # the plan of ds-z2-mb4 launched again: the demo's loop
    "ds-z2-mb8": (TINY, ["--micro-batch", "8"], False),
    "ds-z3-mb4": (TINY, ["--micro-batch", "4", "--zero", "3"], False),
    "ds-z1-mb4": (TINY, ["--micro-batch", "4", "--zero", "1"], False),
    "fsdp-mb4": (TINY, ["--micro-batch", "4", "--backend", "fsdp"], False),
    "megatron-mb2": (TINY_MEGATRON, ["--micro-batch", "2"], True),
    "megatron-mb4": (TINY_MEGATRON, ["--micro-batch", "4"], True),
    "megatron-mb8": (TINY_MEGATRON, ["--micro-batch", "8"], False),
}


def host_recipe(source: Path, work: Path, steps: int) -> Path:
    """The recipe on the host entry, data paths absolute, no checkpoints but the last."""
    recipe = yaml.safe_load(source.read_text())
    recipe["data"]["train_files"] = [str(source.parent / f) for f in recipe["data"]["train_files"]]
    recipe["cluster"]["gpu"] = "cpu"
    recipe["training"].update(max_steps=steps, save_steps=0)
    path = work / f"{source.stem}-host.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def launch(name: str, recipe: Path, flags: list[str], work: Path, port: int) -> Path:
    """torchrun --nproc_per_node 2 toolkit/train.py: a launch without --plan, as launch.sh runs it."""
    out = work / name
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", PATH=f"{Path(sys.executable).parent}:"
               f"{os.environ['PATH']}")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               "--module", "toolkit.train", "--recipe", str(recipe), "--output-dir", str(out), *flags]
    with open(work / f"{name}.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=900, cwd=REPO)
    return out


def dmt(*argv: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "toolkit", *argv, "--json"], capture_output=True, text=True,
                            cwd=REPO, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"dmt {' '.join(argv)} failed: {result.stderr.strip()}")
    return json.loads(result.stdout)


def report(runs: list[Path], calibration: Path | None = None) -> dict[str, dict]:
    extra = ["--calibration", str(calibration)] if calibration else []
    return {Path(r["run_dir"]).name: r for r in dmt("report", *map(str, runs), "--warmup", str(WARMUP), *extra)["runs"]}


def variant(calibration_file: Path, runs: list[Path], name: str) -> Path:
    """The two-term calibration's runs fitted another way, written beside it with the same host peak and links:
    `scale-only`, the compute scale alone (how `dmt calibrate` fitted before the fixed per-step cost), or
    `published`, the published compute scales unfitted (the uncalibrated model at the same host peak)."""
    from toolkit.estimate.calibrate import fit_paths
    from toolkit.report.runs import calibration_runs, read_run
    from toolkit.spec.calibration import load_calibration
    from toolkit.spec.cluster import get_gpu

    calibration = load_calibration(calibration_file)
    data = yaml.safe_load(calibration_file.read_text())
    if name == "scale-only":
        measured, hardware = calibration_runs([read_run(run, WARMUP) for run in runs], WARMUP)
        fitted = fit_paths([run.observation for run in measured], get_gpu(hardware), calibration.host_peak_tflops, calibration.links,
                           fixed_cost=False)
        scales = {path: fit.compute_scale for path, fit in fitted.items()}
    else:
        scales = {path: entry["uncalibrated"] for path, entry in data["efficiency"].items()}
    for path, scale in scales.items():
        data["efficiency"][path].update(compute_scale=scale, fixed_step_s=0.0, fitted="compute_scale")
    out = calibration_file.with_name(f"{calibration_file.stem}-{name}.yaml")
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def leave_one_out(runs: dict[str, Path], work: Path) -> dict[str, dict[str, dict]]:
    """Each run predicted by calibrations fitted on the other runs of its execution path (the runs' own
    run_plan.json names it), two-term and scale-only: {"two-term": {name: dmt report entry}, "scale-only": ...};
    runs whose execution path has no other run are left out."""
    execution_paths = {name: json.loads((out / "run_plan.json").read_text())["execution_path"]
                       for name, out in runs.items()}
    found: dict[str, dict[str, dict]] = {"two-term": {}, "scale-only": {}}
    for name, out in runs.items():
        others = [runs[o] for o in runs if o != name and execution_paths[o] == execution_paths[name]]
        if not others:
            continue
        calibration = work / f"without-{name}.yaml"
        dmt("calibrate", *map(str, others), "--out", str(calibration), "--warmup", str(WARMUP))
        found["two-term"][name] = report([out], calibration)[name]
        found["scale-only"][name] = report([out], variant(calibration, others, "scale-only"))[name]
    return found


# The demo's loop (scripts/demo.sh): `dmt calibrate` on its first run, the tiny recipe as it stands (micro-batch 4,
# ZeRO-2), and the next launch of that plan predicted with it
DEMO_FIT, DEMO_NEXT = "ds-z2-mb4", "ds-z2-mb4-again"
HELD_OUT_LINE = "Held-out error of the CPU calibration"  # scripts/demo.sh prints the line starting so


def one_run_loop(runs: dict[str, Path], work: Path) -> dict[str, dict] | None:
    """The demo's loop: a calibration fitted on DEMO_FIT alone (one run: the compute scale alone), every other run of
    its execution path reported with it ({name: dmt report entry}, each with its launch's prediction beside)."""
    if DEMO_FIT not in runs:
        return None
    execution_paths = {name: json.loads((out / "run_plan.json").read_text())["execution_path"]
                       for name, out in runs.items()}
    others = [out for name, out in runs.items()
              if name != DEMO_FIT and execution_paths[name] == execution_paths[DEMO_FIT]]
    if not others:
        return None
    calibration = work / f"only-{DEMO_FIT}.yaml"
    dmt("calibrate", str(runs[DEMO_FIT]), "--out", str(calibration), "--warmup", str(WARMUP))
    return report(others, calibration)


def one_run_markdown(loop: dict[str, dict], machine: dict) -> list[str]:
    lines = ["", f"## The demo's loop: a calibration fitted on one run ({DEMO_FIT}), the other runs predicted with it",
             "", f"`make demo` calibrates on its first run (the tiny recipe as it stands: micro-batch 4, ZeRO-2) and "
             f"predicts its next launch of that plan with it. Here `dmt calibrate` on {DEMO_FIT} alone (one run: the "
             "compute scale alone, no fixed cost), then `dmt report --calibration` on every other run of its "
             f"execution path; {DEMO_NEXT} is the demo's case, the same plan launched again. *At launch*: the run's "
             "own prediction in run_plan.json (uncalibrated, at the host peak its launch measured), as `dmt report "
             "--calibration` prints it beside the calibrated one.", "",
             "| run | measured s | at launch s | error | calibrated s | error |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in loop.items():
        launch = r["launch_prediction"]
        lines.append(f"| {name} | {_num(r['measured']['step_time_s'])} | {_num(launch['step_time_s'])} | "
                     f"{_pct(launch['step_time_error'])} | {_num(r['predicted']['step_time_s'])} | "
                     f"{_pct(r['error']['step_time'])} |")
    others = [name for name in loop if name != DEMO_NEXT]
    closer = sum(abs(r["error"]["step_time"]) < abs(r["launch_prediction"]["step_time_error"]) for r in loop.values())
    lines += ["", f"Closer than the launch's uncalibrated prediction: {closer} of {len(loop)} runs.", ""]
    if DEMO_NEXT in loop:
        demo = loop[DEMO_NEXT]
        worst = max((abs(loop[n]["error"]["step_time"]) for n in others), default=None)
        worst_text = "-" if worst is None else f"{worst:.0%}"
        lines.append(f"{HELD_OUT_LINE} (one run's, as `make demo` fits it; benchmarks/calibration_cpu.md, "
                     f"{machine['cores']} cores at load {machine['load_before'].split()[0]}-"
                     f"{machine['load_after'].split()[0]}): "
                     f"{_pct(demo['error']['step_time'])} on the next launch of the plan it was fitted on "
                     f"(uncalibrated {_pct(demo['launch_prediction']['step_time_error'])}); on the other plans of "
                     f"its execution path median |error| {_median_abs(loop, others)}, worst {worst_text}.")
    return lines


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _pct(value) -> str:
    return "-" if value is None else f"{value:+.0%}"


def markdown(machine: dict, predictions: dict[str, dict], loo: dict[str, dict], calibration: dict,
             one_run: dict[str, dict] | None = None) -> str:
    """`predictions`: {"published" | "scale-only" | "two-term": {run name: dmt report entry}}."""
    published, scale, two = predictions["published"], predictions["scale-only"], predictions["two-term"]
    how = calibration.get("host_peak") or {}
    lines = [
        "# The calibration loop on a CPU host",
        "",
        "Generated by `benchmarks/calibration_cpu.py`: the tiny recipe (2 layers, hidden 64, seq 64, global batch 16) "
        "on the host catalogue entry `cpu`, 2 ranks under torchrun with gloo, "
        f"{machine['steps']} steps per run, medians after {WARMUP} warm-up records.",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['host']}; torch {machine['torch']}; load "
        f"average (1, 5, 15 min) {machine['load_before']} before the first launch, {machine['load_after']} after the "
        f"last; {machine['date']}.",
        "",
        "## Published, scale alone, scale and fixed cost: fitted on the micro-batch 2 and 4 runs of each execution "
        "path",
        "",
        "Every prediction here uses the host peak the calibration holds (measured by `dmt calibrate` at the runs' "
        f"thread count, {how.get('threads', '?')} threads, load {how.get('load_average', '?')}; the best of that and "
        "the runs' launches, raised where the runs' GEMMs went faster than HOST_GEMM_CEILING of it), so the columns differ only in the fitted figures. *published*: the published "
        "compute scale of the run's execution path, no fixed cost. *scale only*: the compute scale alone fitted (how "
        "`dmt calibrate` fitted before). *scale + fixed*: the compute scale and a fixed per-step cost fitted by least "
        "squares on the log ratio (`dmt calibrate` now). Errors are predicted / measured - 1; runs marked *fit* are "
        "the ones the calibrations saw, the others are held out. One scale cannot fit these runs: at a global batch "
        "of 16, micro-batch 2 runs 4 micro-batches per step and micro-batch 8 one, and the per-step work outside "
        "the model's FLOPs (the Trainer's and DeepSpeed's, the data loader, logging) is comparable to the compute.",
        "",
        "| run | plan | execution path | fit | measured s | published s | error | scale only s | error | scale + fixed s | "
        "error |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, p in published.items():
        plan = p["plan"]
        label = f"{plan['backend']} mb{plan['micro_batch']}" + (f" z{plan['zero']}" if plan["backend"] == "deepspeed"
                                                                else "")
        cells = [f"{_num(r[name]['predicted']['step_time_s'])} | {_pct(r[name]['error']['step_time'])}"
                 for r in (published, scale, two)]
        lines.append(f"| {name} | {label} | {p['execution_path']} | {'fit' if CASES[name][2] else ''} | "
                     f"{_num(p['measured']['step_time_s'])} | {' | '.join(cells)} |")
    held_out = [name for name in published if not CASES[name][2]]
    fitted_runs = [name for name in published if CASES[name][2]]
    lines += ["", "Median |error|:", "",
              "| runs | published | scale only | scale + fixed |", "|---|---:|---:|---:|",
              f"| fitted ({len(fitted_runs)}) | {_median_abs(published, fitted_runs)} | "
              f"{_median_abs(scale, fitted_runs)} | {_median_abs(two, fitted_runs)} |",
              f"| held out ({len(held_out)}) | {_median_abs(published, held_out)} | {_median_abs(scale, held_out)} | "
              f"{_median_abs(two, held_out)} |",
              f"| leave one out ({len(loo['two-term'])}, below) | - | {_median_abs(loo['scale-only'], list(loo['scale-only']))} | "
              f"{_median_abs(loo['two-term'], list(loo['two-term']))} |"]
    lines += ["", "Fitted (calibration.yaml):", ""]
    for path, fitted in calibration["efficiency"].items():
        residual = calibration["residuals"][path]
        lines.append(f"- {path}: compute scale {fitted['compute_scale']:.3g} of the fused-kernel curve (published "
                     f"{fitted['uncalibrated']:.3g}), fixed {fitted['fixed_step_s']:.3g} s per step; residual rms "
                     f"{residual['rms_error']:.1%} over {residual['runs']} runs")
    peaks = ", ".join(f"{k} {v * 1e3:.1f} GFLOP/s" for k, v in (calibration["host_peak_tflops"] or {}).items())
    measured = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in (how.get("measured_tflops") or {}).items())
    launches = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in (how.get("runs_tflops") or {}).items())
    lines.append(f"- host matmul peak kept with it: {peaks} (measured by dmt calibrate: {measured}; best of the "
                 f"runs' launches: {launches} GFLOP/s; the better raised {how.get('raised_by', 1):.3g}x, so that the "
                 f"runs' GEMMs reach at most HOST_GEMM_CEILING of it, toolkit/estimate/calibrate.py "
                 f"fit_host_paths)")
    lines += ["", "## Leave one out", "",
              "Each run predicted by calibrations fitted on every other run of its execution path.", "",
              "| run | measured s | scale only s | error | scale + fixed s | error |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in loo["two-term"].items():
        o = loo["scale-only"][name]
        lines.append(f"| {name} | {_num(r['measured']['step_time_s'])} | {_num(o['predicted']['step_time_s'])} | "
                     f"{_pct(o['error']['step_time'])} | {_num(r['predicted']['step_time_s'])} | "
                     f"{_pct(r['error']['step_time'])} |")
    if one_run:
        lines += one_run_markdown(one_run, machine)
    return "\n".join(lines) + "\n"


def _median_abs(reports: dict, names: list[str]) -> str:
    import statistics

    errors = [abs(reports[n]["error"]["step_time"]) for n in names if reports[n]["error"]["step_time"] is not None]
    return f"{statistics.median(errors):.0%}" if errors else "-"


def _num(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--reuse", action="store_true", help="keep runs already in --work (their run_plan.json says "
                                                             "completed) instead of training them again")
    args = parser.parse_args()
    import torch

    args.work.mkdir(parents=True, exist_ok=True)
    machine = {"cpu": _cpu_model(), "cores": os.cpu_count(), "host": socket.gethostname(), "torch": torch.__version__,
               "steps": args.steps, "load_before": " ".join(f"{v:.1f}" for v in os.getloadavg()),
               "date": time.strftime("%Y-%m-%d")}
    recipes = {source: host_recipe(source, args.work, args.steps) for source in (TINY, TINY_MEGATRON)}
    runs, trained = {}, False
    for index, name in enumerate(args.cases):
        source, flags, _ = CASES[name]
        done = args.work / name / "run_plan.json"
        if args.reuse and done.is_file() and json.loads(done.read_text()).get("status") == "completed":
            runs[name] = args.work / name
            continue
        runs[name] = launch(name, recipes[source], flags, args.work, 29800 + 17 * index)
        trained = True
        print(f"{name}: trained", flush=True)
    record = args.work / "machine.json"  # the machine as it was while the runs trained (kept for --reuse)
    if trained or not record.is_file():
        machine["load_after"] = " ".join(f"{v:.1f}" for v in os.getloadavg())
        record.write_text(json.dumps(machine))
    machine = json.loads(record.read_text())
    fit = [runs[name] for name in runs if CASES[name][2]]
    calibration_file = args.work / "calibration.yaml"
    calibration = dmt("calibrate", *map(str, fit), "--out", str(calibration_file), "--warmup", str(WARMUP))
    every = list(runs.values())
    predictions = {name: report(every, variant(calibration_file, fit, name)) for name in ("published", "scale-only")}
    predictions["two-term"] = report(every, calibration_file)
    loo = leave_one_out(runs, args.work)
    args.out.write_text(markdown(machine, predictions, loo, calibration, one_run_loop(runs, args.work)))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
