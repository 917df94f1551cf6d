"""`dmt slurm render|submit RECIPE`: sbatch scripts with correct rendezvous, preflight, resume and requeue."""

from __future__ import annotations

import argparse
import subprocess
import tempfile

from toolkit.cli.paths import output_arg, path_arg, source_arg
from toolkit.errors import UserInputError
from toolkit.numeric import bounded_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(parser))
    for name, help_text in (("render", "print or write the sbatch script"), ("submit", "render and submit with sbatch")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("recipe", type=path_arg, metavar="RECIPE")
        p.add_argument("--nodes", type=bounded_int, default=None)
        p.add_argument("--gpus-per-node", type=bounded_int, default=None)
        p.add_argument("--partition", default=None)
        p.add_argument("--time", default="24:00:00", help="time limit (default %(default)s)")
        p.add_argument("--account", default=None)
        p.add_argument("--output-dir", default=None, help="training output directory (default runs/<recipe name>)")
        p.add_argument("--deepspeed", type=source_arg, default=None,
                       help="DeepSpeed JSON to train with (default: from the recipe)")
        p.add_argument("--plan", type=path_arg, default=None, metavar="DIR/plan.json",
                       help="train the files `dmt generate` wrote (train.py --plan) instead of resolving the recipe")
        p.add_argument("--launcher", choices=["torchrun", "accelerate", "deepspeed"], default="torchrun",
                       help="how each node starts its ranks (default %(default)s; megatron recipes: torchrun; "
                            "fsdp recipes: torchrun or accelerate)")
        p.add_argument("--accelerate-config", type=source_arg, default=None,
                       help="accelerate.yaml (from dmt generate) for --launcher accelerate")
        p.add_argument("--convert", action="store_true", help="a checkpoint-conversion job instead of training")
        if name == "render":
            p.add_argument("--out", type=output_arg, default=None, help="write here instead of printing")
        else:
            p.add_argument("--dry-run", action="store_true", help="print the script, do not submit")


def render_from_args(args: argparse.Namespace) -> str:
    from toolkit.generate.slurm import render_sbatch

    if args.plan is not None:
        from toolkit.validate.generated import read_generated

        if args.deepspeed:
            raise UserInputError("--deepspeed", "the plan's directory holds its DeepSpeed config; drop --deepspeed")
        run = read_generated(args.plan, args.recipe)
        recipe, plan, flags = run.recipe, run.plan, ["--plan", str(run.directory / "plan.json")]
    else:
        from toolkit.planner.recipe import recipe_plan
        from toolkit.spec.recipe import load_recipe, recipe_model, recipe_names

        recipe = load_recipe(args.recipe)
        with recipe_names():
            plan, flags = recipe_plan(recipe, recipe_model(recipe)), []
    return render_sbatch(recipe, plan, args.recipe, args.nodes, args.gpus_per_node, args.partition, args.time,
                         args.account, args.output_dir, args.deepspeed, "convert" if args.convert else "train",
                         train_flags=flags, launcher=args.launcher, accelerate_config=args.accelerate_config)


def _read_for(args: argparse.Namespace) -> list:
    """What the script is rendered from besides its flags: the recipe's files, and the generated directory of --plan
    (its deepspeed.json, accelerate.yaml, ...), none of which --out may replace."""
    from toolkit.spec.recipe import load_recipe, recipe_files

    plan = [] if args.plan is None else [args.plan if args.plan.is_dir() else args.plan.parent]
    return [*recipe_files(load_recipe(args.recipe)), *plan]


def run(args: argparse.Namespace) -> int:
    from toolkit.outputs import output_file, write_file

    out = getattr(args, "out", None)
    if out is not None:  # checked before anything is resolved: never over the recipe or any file the flags name
        out = output_file(out, "--out")
    script = render_from_args(args)
    if args.action == "render":
        if out is None:
            print(script, end="")
            return 0
        out = output_file(out, "--out", inputs=_read_for(args))  # again, with the files rendering read
        write_file(out, script, "--out", mode=0o755)
        print(f"wrote {out}")
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
