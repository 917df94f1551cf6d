"""`dmt health`: collectives, bandwidth, stragglers and hangs, on every rank, before the real job starts."""

from __future__ import annotations

import argparse
import json
import os

from toolkit.errors import UserInputError


def _sizes(text: str) -> tuple[int, ...]:
    from toolkit.checkpoint.zero_to_hf import parse_size

    return tuple(parse_size(part.replace("K", "KiB").replace("M", "MiB").replace("G", "GiB"), "--sizes")
                 if part[-1] in "KMG" else parse_size(part, "--sizes") for part in text.split(","))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=None, help="spawn N local ranks (without a launcher)")
    parser.add_argument("--sizes", default="1K,64K,1M,16M", help="message sizes (default %(default)s)")
    parser.add_argument("--deadline-s", type=float, default=30.0, help="a rank silent this long is unresponsive")
    parser.add_argument("--straggler-factor", type=float, default=2.0, help="slower than median by this factor")
    parser.add_argument("--min-busbw-gbps", type=float, default=None, help="fail below this all_reduce busbw")
    parser.add_argument("--gpu", default=None, help="GPU from the catalogue, for default bandwidth thresholds")
    parser.add_argument("--expect-devices", type=int, default=None, help="GPUs each rank must see")
    parser.add_argument("--mem-fraction", type=float, default=0.5, help="share of free GPU memory to allocate")
    parser.add_argument("--matmul-seconds", type=float, default=1.0, help="length of the per-rank matmul benchmark")
    parser.add_argument("--pid-dir", default=None, help="each rank writes rank<N>.pid here (for operators and tests)")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from toolkit.health.runner import HealthOptions, run_rank, spawn_local

    for flag, value in (("--deadline-s", args.deadline_s), ("--straggler-factor", args.straggler_factor),
                        ("--matmul-seconds", args.matmul_seconds)):
        if value <= 0:
            raise UserInputError(flag, f"must be positive, got {value}")
    if args.gpu:
        from toolkit.spec.cluster import get_gpu

        get_gpu(args.gpu)
    options = HealthOptions(sizes=_sizes(args.sizes), deadline_s=args.deadline_s, straggler_factor=args.straggler_factor,
                            min_busbw_gbps=args.min_busbw_gbps, matmul_seconds=args.matmul_seconds,
                            mem_fraction=args.mem_fraction, expected_devices=args.expect_devices, gpu=args.gpu,
                            pid_dir=args.pid_dir)
    if args.nproc is not None:
        if args.nproc < 1:
            raise UserInputError("--nproc", f"must be positive, got {args.nproc}")
        report, code = spawn_local(args.nproc, options)
        _print(report, args.json)
        return code
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserInputError("--nproc", "no launcher environment (RANK, WORLD_SIZE): run under torchrun/srun or pass --nproc N")
    return run_rank(options)  # the reporting rank prints the JSON report


def _print(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if Console().is_terminal else 140)
    verdict = "[green]healthy[/]" if report.get("ok") else "[red]NOT healthy[/]"
    console.print(f"{report.get('world_size')} ranks on {', '.join(report.get('hosts', []))}: {verdict}")
    table = Table("op", "bytes", "algbw GB/s", "busbw GB/s", "correct")
    for op, rows in report.get("collectives", {}).items():
        for size, row in rows.items():
            table.add_row(op, size, f"{row['algbw_gbps']:.3f}", f"{row['busbw_gbps']:.3f}", "yes" if row["correct"] else "NO")
    if report.get("collectives"):
        console.print(table)
    for problem in report.get("problems", []):
        console.print(f"[red]problem:[/] {problem}")
