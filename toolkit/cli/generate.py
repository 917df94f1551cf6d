"""`dmt generate RECIPE --out DIR`: every file a launch needs, from one resolved plan."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=Path, metavar="RECIPE")
    parser.add_argument("--out", type=Path, required=True, help="directory for the generated files")
    for flag in ("tp", "pp", "vpp", "cp", "ep", "zero", "micro-batch"):
        parser.add_argument(f"--{flag}", type=int, default=None, help="override the recipe's plan")
    parser.add_argument("--json", action="store_true", help="print the written files and the plan as JSON")


def run(args: argparse.Namespace) -> int:
    from toolkit.generate.files import generate

    overrides = dict(tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, ep=args.ep, zero=args.zero,
                     micro_batch=args.micro_batch)
    written = generate(args.recipe, args.out, **overrides)
    plan = json.loads((args.out / "plan.json").read_text())
    if args.json:
        print(json.dumps({"files": [str(p) for p in written], "plan": plan["plan"], "fits": plan["fits"]}, indent=2))
        return 0
    p = plan["plan"]
    print(f"{plan['recipe']}: {p['backend']} dp={p['dp']} tp={p['tp']} pp={p['pp']} zero={p['zero']} "
          f"micro_batch={p['micro_batch']} grad_accum={p['grad_accum']} global_batch={p['global_batch']} "
          f"({'fits' if plan['fits'] else 'does NOT fit'} {plan['gpu']}, {plan['memory_bytes']['total'] / 2**30:.1f} GiB/GPU)")
    for path in written:
        print(f"  wrote {path}")
    return 0
