"""Restart time, failure to the next step: the tiny Megatron-Core recipe (DP=2 with the distributed optimizer, 2 CPU
ranks over gloo, a synchronous dist checkpoint every 2 steps) launched by the generated launch.sh, rank 1 SIGKILLed
at the start of step 5 (after checkpoint-4) by the toolkit's fault injection (DMT_FAULT), once with
`training.restart: relaunch` (torchrun ends rank 0 and starts both ranks again: new interpreters, imports, process
group, model, checkpoint read) and once with `training.restart: in_process` (NVRx's in-process restart: rank 0's
process goes on, a hot spare takes rank 1's place; new process group, model and checkpoint read in the processes
already running).

Measured from outside, the same way for both: the kill is the fault's log line (its timestamp) plus the 0.5 s the
fault waits before its SIGKILL (toolkit/runtime/faults.py); the next step is the moment a step-5 record appears in
metrics.jsonl again (polled every 50 ms). Also printed: the in-process run's own `resumed` record (incident.json:
from the failure as rank 0 saw it to the end of step 5), and the checkpoint read on restart (train.py's log: the
time from `restart` to the first step, both ranks reading checkpoint-4 from the output directory, i.e. the shared
storage of this machine: one local disk).

Usage: python benchmarks/restart_time.py --work /tmp/restart_time --out benchmarks/restart_time.md [--repeat 2]
Not part of `make test`: 2 launches per repeat of about 1-4 minutes each on a loaded 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TINY_MEGATRON = ROOT / "recipes" / "tiny-llama-megatron-cpu.yaml"
STEPS, SAVE_EVERY, KILL_STEP = 8, 2, 5
FAULT_WAIT_S = 0.5  # toolkit/runtime/faults.py: the fault logs, sleeps 0.5 s, then SIGKILLs
_FAULT_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) toolkit\.runtime\.faults: fault injection: kill",
                         re.M)
MODES = {"relaunch": "torchrun", "in_process": "inprocess"}  # training.restart -> launch.sh's launcher


def recipe(mode: str, work: Path) -> Path:
    data = yaml.safe_load(TINY_MEGATRON.read_text())
    data["name"] = f"restart-{mode.replace('_', '-')}"
    data["data"]["train_files"] = [str(TINY_MEGATRON.parent / f) for f in data["data"]["train_files"]]
    data["plan"]["distributed_optimizer"] = True
    data["training"].update(max_steps=STEPS, save_steps=SAVE_EVERY, async_save=False, restart=mode, max_restarts=1,
                            hang_timeout_s=120, report_to=["none"])
    path = work / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_records(out: Path, step: int) -> int:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return 0
    count = 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        count += record.get("step") == step and record.get("kind") is None
    return count


def run(mode: str, work: Path, tag: str) -> dict:
    from toolkit.cli.main import main
    from toolkit.runtime.incident import read_incidents

    generated, out, log = work / f"{mode}-{tag}-gen", work / f"{mode}-{tag}", work / f"{mode}-{tag}.log"
    assert main(["generate", str(recipe(mode, work)), "--out", str(generated)]) == 0
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", HF_HUB_OFFLINE="1", WANDB_MODE="offline",
               OMP_NUM_THREADS="1", OUTPUT_DIR=str(out), MASTER_PORT=str(free_port()),
               DMT_FAULT=f"kill@rank=1,step={KILL_STEP},phase=train")
    started, next_step = time.time(), None
    with open(log, "w") as handle:
        proc = subprocess.Popen(["bash", str(generated / "launch.sh"), MODES[mode]], stdout=handle,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        killed_seen = False
        while proc.poll() is None:
            if not killed_seen:
                killed_seen = bool(_FAULT_LINE.search(log.read_text()))
            elif next_step is None and step_records(out, KILL_STEP) == 1:  # the attempt killed never logged step 5
                next_step = time.time()
            time.sleep(0.05)
    text = log.read_text()
    match = _FAULT_LINE.search(text)
    if proc.returncode != 0 or match is None or next_step is None:
        raise SystemExit(f"{mode}: the launch ended with {proc.returncode} (log: {log})")
    logged = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    kill = logged + FAULT_WAIT_S
    resumed = [e for e in read_incidents(out) if e["event"] == "resumed"]
    return {"mode": mode, "failure_to_next_step_s": next_step - kill, "run_s": time.time() - started,
            "in_run_restart_s": resumed[0]["restart_s"] if resumed else None,
            "load_at_kill": os.getloadavg()[0]}


def main_(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    rows = []
    for repeat in range(args.repeat):
        for mode in MODES:
            rows.append(run(mode, args.work, str(repeat)))
            print(json.dumps(rows[-1]), flush=True)
    lines = [
        "# Restart time: relaunch vs in-process (2 CPU ranks, tiny Megatron-Core)",
        "",
        f"`python benchmarks/restart_time.py --work {args.work} --repeat {args.repeat}` on {platform.node()} "
        f"({os.cpu_count()} cores, {platform.machine()}), {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
        f"UTC; load average before: {load_before[0]:.1f} (1 min), {load_before[2]:.1f} (15 min) — the machine is "
        "shared, figures move with its load.",
        "",
        "| restart | failure to next step (s) | in-run record `restart_s` (s) | whole run (s) | load at the time |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        in_run = f"{row['in_run_restart_s']:.1f}" if row["in_run_restart_s"] is not None else "-"
        lines.append(f"| {row['mode']} | {row['failure_to_next_step_s']:.1f} | {in_run} | {row['run_s']:.0f} | "
                     f"{row['load_at_kill']:.1f} |")
    for mode in MODES:
        times = [r["failure_to_next_step_s"] for r in rows if r["mode"] == mode]
        lines.append(f"\nmedian {mode}: {statistics.median(times):.1f} s")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main_())
