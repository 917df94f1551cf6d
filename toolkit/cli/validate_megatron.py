"""Check a megatron.yaml before launching: `python -m toolkit.cli.validate_megatron FILE [--world-size N] [--json]`.

Shaped like every verb module (add_arguments + run), so `dmt validate` can hand .yaml files to it.
"""

from __future__ import annotations

import argparse
import sys

from toolkit.cli.paths import path_arg
from toolkit.errors import UserInputError
from toolkit.numeric import bounded_int, json_text
from toolkit.validate.megatron import padding_note, read_megatron_yaml, validate_megatron_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=path_arg, metavar="FILE", help="megatron.yaml (generated or hand-edited)")
    parser.add_argument("--world-size", type=bounded_int, default=None, help="processes the job will launch (default: the "
                                                                     "file's schedule.world_size)")
    parser.add_argument("--json", action="store_true", help="print one JSON object: ok, the problems and notes")


def run(args: argparse.Namespace) -> int:
    if args.world_size is not None and args.world_size < 1:
        raise UserInputError("--world-size", f"must be positive, got {args.world_size}")
    config = read_megatron_yaml(args.file)
    problems = validate_megatron_config(config, args.world_size)
    note = None if problems else padding_note(config)
    if args.json:
        print(json_text({"ok": not problems, "problems": [{"key": p.key, "message": p.message} for p in problems],
                          "notes": [note] if note else []}))
    elif problems:
        for problem in problems:
            print(f"{args.file}: {problem}", file=sys.stderr)
    else:
        world = args.world_size or config["schedule"]["world_size"]
        print(f"{args.file}: valid for world size {world}" + (f"; {note}" if note else ""))
    return 2 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.cli.validate_megatron", description=__doc__,
                                     allow_abbrev=False)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except UserInputError as exc:
        print(f"validate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
