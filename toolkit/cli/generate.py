"""`dmt generate RECIPE --out DIR`: every file a launch needs, from one resolved plan."""

from __future__ import annotations

import argparse

from toolkit.cli.common import add_calibration_argument, calibration_line, sharding_text
from toolkit.cli.options import add_plan_flags, plan_overrides
from toolkit.cli.paths import output_arg, path_arg
from toolkit.generate.files import generate
from toolkit.numeric import json_text
from toolkit.readers import read_json
from toolkit.spec.prediction import PlanFile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=path_arg, metavar="RECIPE")
    parser.add_argument("--out", type=output_arg, required=True, help="directory for the generated files")
    parser.add_argument("--force", action="store_true", help="replace files in --out that dmt generate did not write "
                                                             "(or that were edited since)")
    parser.add_argument("--json", action="store_true", help="print the written files and the plan as JSON")
    add_calibration_argument(parser, "plan.json's prediction (and the planner's ranking with plan: auto), in place "
                                     "of the recipe's cluster.calibration,")
    add_plan_flags(parser, overriding="the recipe's plan")


def run(args: argparse.Namespace) -> int:
    written = generate(args.recipe, args.out, args.force, args.calibration, **plan_overrides(args))

    record = PlanFile.model_validate(read_json(args.out / "plan.json", "--out", what="the plan.json just written"))
    if args.json:
        print(json_text({"files": [str(p) for p in written], "plan": record.plan.as_dict(), "fits": record.fits,
                          "predicted": {k: getattr(record, k) for k in ("step_time_s", "tokens_per_s", "mfu")},
                          "calibration": record.calibration}, indent=2))
        return 0
    p = record.plan
    print(f"{record.recipe}: {p.backend} dp={p.dp} tp={p.tp} pp={p.pp} {sharding_text(p)} "
          f"micro_batch={p.micro_batch} grad_accum={p.grad_accum} global_batch={p.global_batch} "
          f"({'fits' if record.fits else 'does NOT fit'} {record.gpu}, "
          f"{record.memory_bytes.total / 2**30:.1f} GiB/GPU)")
    print(f"predicted step {record.step_time_s:.3g} s, {record.tokens_per_s:,.0f} tokens/s, MFU "
          f"{record.mfu:.1%}; {calibration_line(record.calibration)}")
    for path in written:
        print(f"  wrote {path}")
    return 0
