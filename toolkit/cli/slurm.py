"""`dmt slurm render|submit RECIPE`: sbatch scripts with correct rendezvous, preflight, resume and requeue."""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from toolkit.errors import UserInputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(parser))
    for name, help_text in (("render", "print or write the sbatch script"), ("submit", "render and submit with sbatch")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("recipe", type=Path, metavar="RECIPE")
        p.add_argument("--nodes", type=int, default=None)
        p.add_argument("--gpus-per-node", type=int, default=None)
        p.add_argument("--partition", default=None)
        p.add_argument("--time", default="24:00:00", help="time limit (default %(default)s)")
        p.add_argument("--account", default=None)
        p.add_argument("--output-dir", default=None, help="training output directory (default runs/<recipe name>)")
        p.add_argument("--deepspeed", default=None, help="DeepSpeed JSON to train with (default: from the recipe)")
        p.add_argument("--launcher", choices=["torchrun", "accelerate", "deepspeed"], default="torchrun",
                       help="how each node starts its ranks (default %(default)s; megatron recipes: torchrun; "
                            "fsdp recipes: torchrun or accelerate)")
        p.add_argument("--accelerate-config", default=None, help="accelerate.yaml (from dmt generate) for "
                                                                 "--launcher accelerate")
        p.add_argument("--convert", action="store_true", help="a checkpoint-conversion job instead of training")
        if name == "render":
            p.add_argument("--out", type=Path, default=None, help="write here instead of printing")
        else:
            p.add_argument("--dry-run", action="store_true", help="print the script, do not submit")


def render_from_args(args: argparse.Namespace) -> str:
    from toolkit.generate.slurm import render_sbatch
    from toolkit.planner.recipe import recipe_plan
    from toolkit.spec.recipe import load_recipe, recipe_model

    recipe = load_recipe(args.recipe)
    plan = recipe_plan(recipe, recipe_model(recipe))
    return render_sbatch(recipe, plan, args.recipe, args.nodes, args.gpus_per_node, args.partition, args.time,
                         args.account, args.output_dir, args.deepspeed, "convert" if args.convert else "train",
                         launcher=args.launcher, accelerate_config=args.accelerate_config)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "out", None) is not None and not args.out.parent.is_dir():
        raise UserInputError("--out", f"directory {args.out.parent} does not exist")
    script = render_from_args(args)
    if args.action == "render":
        if args.out is None:
            print(script, end="")
            return 0
        tmp = args.out.with_name(f".{args.out.name}.tmp-{os.getpid()}")
        tmp.write_text(script)
        tmp.chmod(0o755)
        os.replace(tmp, args.out)
        print(f"wrote {args.out}")
        return 0
    if args.dry_run:
        print(script, end="")
        return 0
    from toolkit.generate.slurm import slurm_log_dir
    from toolkit.spec.recipe import load_recipe

    slurm_log_dir(load_recipe(args.recipe), args.output_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".sbatch", delete=False) as handle:
        handle.write(script)
    try:
        result = subprocess.run(["sbatch", "--parsable", handle.name], capture_output=True, text=True)
    except FileNotFoundError:
        raise UserInputError("submit", "sbatch is not on PATH (is this a Slurm login node?)") from None
    if result.returncode != 0:
        raise UserInputError("sbatch", result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed")
    job_id = result.stdout.strip().split(";")[0]
    print(job_id)
    return 0
