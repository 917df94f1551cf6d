"""`dmt ckpt verify|inspect`: is a checkpoint complete and intact, and what is in it."""

from __future__ import annotations

import argparse

from toolkit.checkpoint.verify import inspect, verify
from toolkit.cli.paths import path_arg
from toolkit.numeric import json_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(parser))
    verify = sub.add_parser("verify", help="completeness, sizes and checksums (against the manifest); --deep loads tensors")
    verify.add_argument("path", type=path_arg, metavar="PATH")
    verify.add_argument("--deep", action="store_true", help="load every tensor and check for NaN/Inf")
    verify.add_argument("--json", action="store_true")
    inspect = sub.add_parser("inspect", help="format, step, layout, parameter count, optimizer state, dtypes, size")
    inspect.add_argument("path", type=path_arg, metavar="PATH")
    inspect.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.action == "inspect":
        info = inspect(args.path)
        if args.json:
            print(json_text(info, indent=2))
        else:
            for key, value in info.items():
                print(f"{key:16s} {value}")
        return 0
    report = verify(args.path, deep=args.deep)
    if args.json:
        print(json_text(report.as_dict(), indent=2))
    else:
        _print_report(report)
    return 0 if report.ok else 1


def _print_report(report) -> None:
    """A table on a terminal; plain `file: problem` lines, never cut, when piped or redirected (a cut file name is
    the one thing the reader was looking for)."""
    import sys

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    source = "manifest" if report.manifest else "structure (no manifest)"
    summary = (f"{report.path}: {report.format}, checked against {source}, {report.files_checked} files, "
               f"{report.tensors_checked} tensors: ")
    if not sys.stdout.isatty():
        print(summary + ("sound" if report.ok else f"{len(report.problems)} problem(s)"))
        for problem in report.problems:
            print(f"{problem['file']}: {problem['problem']}")
        return
    console = Console()
    verdict = "[green]sound[/]" if report.ok else f"[red]{len(report.problems)} problem(s)[/]"
    console.print(escape(summary) + verdict, highlight=False)
    if report.problems:
        table = Table("file", "problem")
        table.columns[0].overflow = table.columns[1].overflow = "fold"  # wrapped, never cut with an ellipsis
        for problem in report.problems:
            table.add_row(problem["file"], problem["problem"])
        console.print(table)
