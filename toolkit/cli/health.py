"""`dmt health`: collectives, bandwidth, stragglers and hangs on every rank, before the real job starts."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from toolkit.cli.console import console as make_console
from toolkit.cli.paths import output_arg
from toolkit.errors import UserInputError
from toolkit.health.options import HealthOptions, rank_env, validate
from toolkit.health.runner import run_rank, spawn_local
from toolkit.numeric import BUSBW, DEADLINE, STRAGGLER, bounded_int, finite_float, json_text
from toolkit.outputs import output_file, write_file
from toolkit.spec.cluster import get_gpu

SIZE_MAX = 2**40
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?)(i?B?)\s*$", re.IGNORECASE)


def parse_sizes(text: str) -> tuple[int, ...]:
    """'1K,64K,1M,16M' -> bytes. K/M/G and KiB/MiB/GiB are binary (as nccl-tests' -b/-e), KB/MB/GB decimal."""
    sizes = []
    for part in text.split(","):
        match = _SIZE.fullmatch(part)
        if not match:
            raise UserInputError("--sizes", f"'{part}' is not a size; use e.g. 1K,64K,1M,16M")
        number, unit, suffix = float(match.group(1)), match.group(2).upper(), match.group(3).upper()
        base = 1000 if suffix == "B" and unit else 1024
        size = number * base ** ("KMG".index(unit) + 1 if unit else 0)
        if size > SIZE_MAX:  # a buffer per rank in device memory: past a TiB it is a slip, not a benchmark
            raise UserInputError("--sizes", f"'{part[:40]}' is more than 1 TiB")
        if size < 4:
            raise UserInputError("--sizes", f"'{part}' is smaller than one float32 element (4 bytes)")
        sizes.append(int(size))
    return tuple(sorted(set(sizes)))


LAUNCHERS = """launchers (every rank runs `dmt health`; rank 0 prints the report):
  dmt health --nproc 2                                      spawn local ranks (gloo on CPU, nccl on GPUs)
  torchrun --nproc_per_node 8 -m toolkit health --output health.json
  srun --ntasks-per-node 8 dmt health --output health.json  (export MASTER_ADDR, MASTER_PORT first)
  deepspeed --num_gpus 8 --no_local_rank --module toolkit health
  accelerate launch --multi_gpu --num_processes 8 -m toolkit health
exit code: 0 healthy, 1 not healthy (a problem, a straggler, an unresponsive or dead rank), 2 bad input"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = LAUNCHERS
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    run = parser.add_argument_group("how to run")
    run.add_argument("--nproc", type=bounded_int, default=None,
                     help="spawn N local ranks; without it, run as one rank of torchrun/srun/deepspeed/accelerate")
    run.add_argument("--sizes", default=None, help="message sizes, e.g. 1K,64K,1M,16M (default: up to 16M on CPU, 1G on GPUs)")
    run.add_argument("--iters", type=bounded_int, default=None, help="timed iterations per op and size (default 5 CPU, 20 GPU)")
    run.add_argument("--matmul-seconds", type=DEADLINE, default=1.0, help="length of the per-rank matmul benchmark (default 1)")
    run.add_argument("--mem-fraction", type=finite_float, default=0.5, help="share of free GPU memory each rank allocates (default 0.5)")
    run.add_argument("--pid-dir", default=None, help="each rank writes rank<N>.pid here (to attach a debugger)")
    limits = parser.add_argument_group("thresholds (GPU defaults from the catalogue; on CPU only liveness, "
                                       "correctness, stragglers and outlier links count unless given)")
    limits.add_argument("--deadline-s", type=DEADLINE, default=60.0,
                        help="a rank silent this long, or a collective waiting this long, is unresponsive (default 60)")
    limits.add_argument("--straggler-factor", type=STRAGGLER, default=2.0,
                        help="a rank (or link) this many times slower than the others' median is named (default 2)")
    limits.add_argument("--min-busbw-gbps", type=BUSBW, default=None,
                        help="intra-node all_reduce busbw floor (default: half the catalogue link speed on GPUs)")
    limits.add_argument("--min-inter-busbw-gbps", type=BUSBW, default=None,
                        help="inter-node all_reduce busbw floor (default: half the catalogue network speed on GPUs)")
    limits.add_argument("--min-matmul-fraction", type=finite_float, default=0.25,
                        help="on GPUs, share of the catalogue's dense bf16 peak the matmul must reach (default 0.25)")
    limits.add_argument("--gpu", default=None, help="catalogue GPU for the defaults (default: recognised from the device)")
    limits.add_argument("--expect-devices", type=bounded_int, default=None,
                        help="GPUs each rank must see (default: the launcher's ranks per node)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the report as one JSON object")
    out.add_argument("--output", type=output_arg, default=None,
                     help="also write the JSON report here (for dmt plan --measured-bw)")


def run(args: argparse.Namespace) -> int:
    if args.gpu:
        get_gpu(args.gpu)
    options = HealthOptions(sizes=parse_sizes(args.sizes) if args.sizes else None, iters=args.iters,
                            deadline_s=args.deadline_s, straggler_factor=args.straggler_factor,
                            min_busbw_gbps=args.min_busbw_gbps, min_inter_busbw_gbps=args.min_inter_busbw_gbps,
                            min_matmul_fraction=args.min_matmul_fraction, matmul_seconds=args.matmul_seconds,
                            mem_fraction=args.mem_fraction, expected_devices=args.expect_devices, gpu=args.gpu,
                            pid_dir=str(args.pid_dir) if args.pid_dir else None)
    validate(options)
    if args.pid_dir and not Path(args.pid_dir).is_dir():
        raise UserInputError("--pid-dir", f"{args.pid_dir} is not a directory")
    if args.output:  # checked before any rank starts; written whole at the end

        args.output = output_file(args.output, "--output")
    if args.nproc is not None:
        if args.nproc < 1:
            raise UserInputError("--nproc", f"must be at least 1, got {args.nproc}")

        report, code = spawn_local(args.nproc, options)
        _emit(report, args)
        return code
    env = rank_env()
    if env is None:
        raise UserInputError("--nproc", "no launcher environment (RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS): "
                                        "run under torchrun/srun/deepspeed/accelerate, or pass --nproc N")
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    return run_rank(options, env, lambda report, _store: _emit(report, args))


def _emit(report: dict, args: argparse.Namespace) -> None:
    if args.output:
        write_file(args.output, json_text(report, indent=2) + "\n", "--output")
    if args.json:
        print(json_text(report, indent=2), flush=True)
    else:
        _print_table(report)


def _print_table(report: dict) -> None:
    from rich.table import Table

    console = make_console()
    verdict = "[green]healthy[/]" if report.get("ok") else f"[red]NOT healthy[/] ({report.get('phase')})"
    console.print(f"dmt health: {report.get('world_size')} ranks on {', '.join(report.get('hosts', [])) or '?'}: {verdict}")
    if report.get("ranks"):
        ranks = Table("rank", "host", "device", "cpus", "matmul ms", "GFLOP/s", "memory", title="ranks")
        for facts in report["ranks"]:
            device = facts.get("gpu_name") or facts["device"]
            ranks.add_row(str(facts["rank"]), facts["host"], device, facts.get("cpu_affinity") or "-",
                          f"{facts['matmul_ms']:.2f}", f"{facts['matmul_gflops']:.1f}",
                          "FAILED" if facts.get("memory_check") else "ok")
        console.print(ranks)
        if spread := matmul_spread(report["ranks"]):
            console.print(spread)
    if report.get("collectives"):
        table = Table("op", "size", "time us", "algbw GB/s", "busbw GB/s", "correct",
                      title="collectives (nccl-tests definitions)")
        for op, rows in report["collectives"].items():
            for size, row in rows.items():
                table.add_row(op, _size(int(size)), f"{row['time_s'] * 1e6:.1f}", f"{row['algbw_gbps']:.3f}",
                              f"{row['busbw_gbps']:.3f}", "yes" if row["correct"] else "[red]NO[/]")
        console.print(table)
    bandwidth = report.get("bandwidth") or {}
    fmt = lambda v: "-" if v is None else f"{v:.2f} GB/s"  # noqa: E731
    console.print(f"all_reduce busbw: intra-node {fmt(bandwidth.get('intra_node_busbw_gbps'))}, "
                  f"inter-node {fmt(bandwidth.get('inter_node_busbw_gbps'))}")
    if report.get("links"):
        links = (f"{link['src']}<->{link['dst']} {link['gbps']:.2f} GB/s" for link in report["links"])
        console.print("ring links: " + ", ".join(links))
    for problem in report.get("problems", []):
        console.print(f"[red]problem:[/] {problem}")
    for warning in report.get("warnings", []):
        console.print(f"[yellow]warning:[/] {warning}")


def matmul_spread(ranks: list[dict]) -> str | None:
    """The per-rank spread as `dmt report --breakdown` words a training run's, for the one term a preflight measures
    (compute: the matmul); None with one rank."""
    if len(ranks) < 2:
        return None
    slowest, fastest = (max(ranks, key=lambda f: f["matmul_ms"]), min(ranks, key=lambda f: f["matmul_ms"]))
    return (f"per-rank spread (slowest less fastest rank): matmul {slowest['matmul_ms'] - fastest['matmul_ms']:.2f} ms, "
            f"all of it compute (the one term measured here); slowest rank: {slowest['rank']} ({slowest['host']})")


def _size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)
