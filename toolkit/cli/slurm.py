"""`dmt slurm render|submit RECIPE`: sbatch scripts with correct rendezvous, preflight, resume and requeue."""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from toolkit.cli.common import rendered_from
from toolkit.cli.paths import output_arg, path_arg, source_arg
from toolkit.errors import UserInputError
from toolkit.generate.ft_launcher import FILE as FT_FILE
from toolkit.generate.slurm import render_sbatch, slurm_log_dir
from toolkit.numeric import bounded_int
from toolkit.outputs import output_file, write_file
from toolkit.planner.recipe import recipe_plan
from toolkit.readers import read_json, read_yaml
from toolkit.spec.backends import backend_of
from toolkit.spec.recipe import load_recipe, recipe_model, recipe_names
from toolkit.validate.deepspeed import validate_deepspeed_config
from toolkit.validate.generated import read_generated


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
        p.add_argument("--output-dir", type=output_arg, default=None, help="training output directory (default runs/<recipe name>)")
        p.add_argument("--deepspeed", type=source_arg, default=None,
                       help="DeepSpeed JSON to train with (default: from the recipe)")
        p.add_argument("--plan", type=path_arg, default=None, metavar="DIR/plan.json",
                       help="train the files `dmt generate` wrote (train.py --plan) instead of resolving the recipe")
        p.add_argument("--launcher", choices=["torchrun", "accelerate", "deepspeed", "ft_launcher"], default="torchrun",
                       help="how each node starts its ranks (default %(default)s; megatron recipes: torchrun; "
                            "fsdp recipes: torchrun or accelerate; ft_launcher wherever torchrun, with --plan)")
        p.add_argument("--accelerate-config", type=source_arg, default=None,
                       help="accelerate.yaml (from dmt generate) for --launcher accelerate")
        p.add_argument("--convert", action="store_true", help="a checkpoint-conversion job instead of training")
        if name == "render":
            p.add_argument("--out", type=output_arg, default=None, help="write here instead of printing")
        else:
            p.add_argument("--dry-run", action="store_true", help="print the script, do not submit")


def render_from_args(args: argparse.Namespace) -> str:
    if args.plan is not None:
        if args.deepspeed:
            raise UserInputError("--deepspeed", "the plan's directory holds its DeepSpeed config; drop --deepspeed")
        run = read_generated(args.plan, args.recipe)
        recipe, plan, flags = run.recipe, run.plan, ["--plan", str(run.directory / "plan.json")]
        ft_config = str(run.directory / FT_FILE) if (run.directory / FT_FILE).is_file() else None
    else:
        recipe = load_recipe(args.recipe)
        with recipe_names():
            plan, flags = recipe_plan(recipe, recipe_model(recipe)), []
        ft_config = None
    script = render_sbatch(recipe, plan, args.recipe, args.nodes, args.gpus_per_node, args.partition, args.time,
                           args.account, args.output_dir, _str(args.deepspeed), "convert" if args.convert else "train",
                           train_flags=flags, launcher=args.launcher, accelerate_config=_str(args.accelerate_config), ft_config=ft_config)
    _check_launch_files(args, plan)
    return script


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _check_launch_files(args: argparse.Namespace, plan) -> None:
    """The DeepSpeed JSON and the accelerate.yaml the job will train with, read and checked for the job's world size
    now: a missing, truncated or wrong one is one line here, not a failed job after its wait in the queue."""
    if args.deepspeed is not None:
        config = read_json(args.deepspeed, "--deepspeed", what="a DeepSpeed config (a JSON object)")
        problems = validate_deepspeed_config(config, plan.gpus, config_path=args.deepspeed)
        if problems:
            raise UserInputError("--deepspeed", f"{args.deepspeed}: {problems[0]}")
    if args.accelerate_config is not None:
        if args.launcher != "accelerate":
            raise UserInputError("--accelerate-config", f"only --launcher accelerate reads it, not {args.launcher}")
        check = backend_of(plan).validate.accelerate_launch
        if check is None:
            raise UserInputError("--launcher", f"the {plan.backend} backend does not run under accelerate")
        config = read_yaml(args.accelerate_config, "--accelerate-config", what="an Accelerate config (accelerate.yaml)")
        problems = check(config, plan.gpus)
        if problems:
            raise UserInputError("--accelerate-config", f"{args.accelerate_config}: {problems[0]}")


def run(args: argparse.Namespace) -> int:
    out = getattr(args, "out", None)
    if out is not None:  # checked before anything is resolved: never over the recipe or any file the flags name
        out = output_file(out, "--out")
    script = render_from_args(args)
    if args.action == "render":
        if out is None:
            print(script, end="")
            return 0

        out = output_file(out, "--out", inputs=rendered_from(args))  # again, with the files rendering read
        write_file(out, script, "--out", mode=0o755)
        print(f"wrote {out}")
        return 0
    if args.dry_run:
        print(script, end="")
        return 0

    slurm_log_dir(load_recipe(args.recipe), args.output_dir).mkdir(parents=True, exist_ok=True)
    # sbatch copies the script when it submits it: the temporary file goes however this ends (Ctrl-C included)
    handle, name = tempfile.mkstemp(prefix="dmt-", suffix=".sbatch")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(script)
        result = subprocess.run(["sbatch", "--parsable", name], capture_output=True, text=True)
    except FileNotFoundError:
        raise UserInputError("submit", "sbatch is not on PATH (is this a Slurm login node?)") from None
    finally:
        os.unlink(name)
    if result.returncode != 0:
        raise UserInputError("sbatch", result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed")
    job_id = result.stdout.strip().split(";")[0]
    print(job_id)
    return 0
