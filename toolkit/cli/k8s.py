"""`dmt k8s render RECIPE --kind trainjob|jobset|pytorchjob --image IMAGE [--out FILE]`: the recipe's plan as a
Kubernetes manifest, checked against the operators' CRDs before it is printed or written. There is no API server
here: the command says `kubectl apply -f FILE`, it never submits."""

from __future__ import annotations

import argparse
import sys

from toolkit.cli.common import rendered_from
from toolkit.cli.paths import output_arg, path_arg
from toolkit.errors import UserInputError
from toolkit.generate.ft_launcher import FILE as FT_FILE
from toolkit.generate.k8s.render import CHECKPOINT_MOUNT, KINDS, WORKDIR, make_job, manifest_text
from toolkit.outputs import output_file, write_file
from toolkit.planner.recipe import recipe_plan
from toolkit.readers import parse_yaml_documents
from toolkit.spec.recipe import load_recipe, recipe_model, recipe_names
from toolkit.validate.generated import read_generated
from toolkit.validate.k8s.manifests import validate_manifest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(parser))
    p = sub.add_parser("render", help="print or write the manifest (a TrainJob, a JobSet or a PyTorchJob)")
    p.add_argument("recipe", type=path_arg, metavar="RECIPE")
    p.add_argument("--kind", choices=KINDS, required=True,
                   help="trainjob: Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1); jobset: jobset.x-k8s.io/"
                        "v1alpha2; pytorchjob: Kubeflow's legacy kubeflow.org/v1 operator")
    p.add_argument("--image", default=None, help=f"container image holding the toolkit and this directory at {WORKDIR} "
                                                 f"(default: the recipe's cluster.k8s.image)")
    p.add_argument("--out", type=output_arg, default=None, help="write here instead of printing")
    p.add_argument("--namespace", default=None, help="the namespace (default: kubectl's current one)")
    p.add_argument("--checkpoint-pvc", default=None, metavar="NAME",
                   help=f"PersistentVolumeClaim mounted at {CHECKPOINT_MOUNT} for the run's checkpoints "
                        f"(default <job name>-checkpoints)")
    p.add_argument("--queue", default=None, metavar="NAME",
                   help="Kueue LocalQueue (the kueue.x-k8s.io/queue-name label)")
    p.add_argument("--plan", type=path_arg, default=None, metavar="DIR/plan.json",
                   help="train the files `dmt generate` wrote (train.py --plan) instead of resolving the recipe")
    p.add_argument("--launcher", choices=["torchrun", "ft_launcher"], default="torchrun",
                   help="what starts each node's ranks (default %(default)s); ft_launcher: NVIDIA Resiliency "
                        "Extension's torchrun drop-in with the generated ft_config.yaml (needs --plan)")


def render_from_args(args: argparse.Namespace) -> str:
    from pathlib import Path

    if args.plan is not None:
        run = read_generated(args.plan, args.recipe)
        recipe, plan = run.recipe, run.plan
        plan_path = run.directory / "plan.json"
    else:
        recipe = load_recipe(args.recipe)
        with recipe_names():
            plan, plan_path = recipe_plan(recipe, recipe_model(recipe)), None
    ft_config = None
    if args.launcher == "ft_launcher":
        if plan_path is None:
            raise UserInputError("--launcher", "ft_launcher reads the ft_config.yaml `dmt generate` writes: pass --plan "
                                               "with the generated directory")
        ft_config = plan_path.parent / FT_FILE
    job = make_job(recipe, plan, args.image, Path(args.recipe), plan_path, args.namespace, args.checkpoint_pvc,
                   args.queue, ft_config=ft_config)
    text = manifest_text(job, args.kind)
    _check(text)
    return text


def _check(text: str) -> None:
    """What is written must pass `dmt validate` (a bug here, not the user's input, if it does not)."""
    problems = validate_manifest(parse_yaml_documents(text, "the rendered manifest"))
    if problems:
        raise AssertionError(f"the rendered manifest fails its own check: {problems[0]}")


def run(args: argparse.Namespace) -> int:
    out = args.out
    if out is not None:  # checked before anything is resolved: never over the recipe or any file the flags name
        out = output_file(out, "--out")
    text = render_from_args(args)
    if out is None:
        print(text, end="")
        print("# no API server here: to submit, `kubectl apply -f` this manifest saved to a file", file=sys.stderr)
        return 0
    import shlex

    out = output_file(out, "--out", inputs=rendered_from(args))  # again, with the files rendering read
    write_file(out, text, "--out")
    print(f"wrote {out}")
    print(f"submit with: kubectl apply -f {shlex.quote(str(out))}")
    return 0

