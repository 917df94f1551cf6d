"""`dmt generate RECIPE --out DIR`: every file a launch needs, from one resolved plan."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# plan overrides shared with toolkit/train.py, so launch.sh can hand the same ones to the training processes
OVERRIDE_FLAGS = ("tp", "pp", "vpp", "cp", "ep", "zero", "micro-batch")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=Path, metavar="RECIPE")
    parser.add_argument("--out", type=Path, required=True, help="directory for the generated files")
    parser.add_argument("--backend", choices=["deepspeed", "megatron"], default=None, help="override the recipe's plan")
    for flag in OVERRIDE_FLAGS:
        parser.add_argument(f"--{flag}", type=int, default=None, help="override the recipe's plan")
    parser.add_argument("--json", action="store_true", help="print the written files and the plan as JSON")


def overrides_from_args(args: argparse.Namespace) -> dict:
    names = ["backend", *(flag.replace("-", "_") for flag in OVERRIDE_FLAGS)]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def run(args: argparse.Namespace) -> int:
    from toolkit.generate.files import generate

    written = generate(args.recipe, args.out, **overrides_from_args(args))
    record = json.loads((args.out / "plan.json").read_text())
    if args.json:
        print(json.dumps({"files": [str(p) for p in written], "plan": record["plan"], "fits": record["fits"]}, indent=2))
        return 0
    p = record["plan"]
    print(f"{record['recipe']}: {p['backend']} dp={p['dp']} tp={p['tp']} pp={p['pp']} zero={p['zero']} "
          f"micro_batch={p['micro_batch']} grad_accum={p['grad_accum']} global_batch={p['global_batch']} "
          f"({'fits' if record['fits'] else 'does NOT fit'} {record['gpu']}, "
          f"{record['memory_bytes']['total'] / 2**30:.1f} GiB/GPU)")
    for path in written:
        print(f"  wrote {path}")
    return 0
