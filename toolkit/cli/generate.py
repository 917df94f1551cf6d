"""`dmt generate RECIPE --out DIR`: every file a launch needs, from one resolved plan."""

from __future__ import annotations

import argparse
import json

from toolkit.cli.options import add_plan_flags, plan_overrides
from toolkit.cli.paths import path_arg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=path_arg, metavar="RECIPE")
    parser.add_argument("--out", type=path_arg, required=True, help="directory for the generated files")
    parser.add_argument("--force", action="store_true", help="replace files in --out that dmt generate did not write "
                                                             "(or that were edited since)")
    parser.add_argument("--json", action="store_true", help="print the written files and the plan as JSON")
    add_plan_flags(parser, overriding="the recipe's plan")


def run(args: argparse.Namespace) -> int:
    from toolkit.cli.common import sharding_text
    from toolkit.generate.files import generate

    written = generate(args.recipe, args.out, args.force, **plan_overrides(args))
    record = json.loads((args.out / "plan.json").read_text())
    if args.json:
        print(json.dumps({"files": [str(p) for p in written], "plan": record["plan"], "fits": record["fits"]}, indent=2))
        return 0
    p = record["plan"]
    print(f"{record['recipe']}: {p['backend']} dp={p['dp']} tp={p['tp']} pp={p['pp']} {sharding_text(p)} "
          f"micro_batch={p['micro_batch']} grad_accum={p['grad_accum']} global_batch={p['global_batch']} "
          f"({'fits' if record['fits'] else 'does NOT fit'} {record['gpu']}, "
          f"{record['memory_bytes']['total'] / 2**30:.1f} GiB/GPU)")
    for path in written:
        print(f"  wrote {path}")
    return 0
