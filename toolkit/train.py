"""The launchable training entry: `deepspeed|accelerate launch|torchrun toolkit/train.py --recipe R [...]`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script by a launcher: make `toolkit` importable from the repo checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from toolkit.cli.options import add_plan_flags, plan_overrides  # noqa: E402
from toolkit.errors import UserInputError  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toolkit/train.py", description=__doc__)
    parser.add_argument("--recipe", required=True, type=Path)
    parser.add_argument("--deepspeed", default=None, help="DeepSpeed JSON (default: generated from the recipe's plan)")
    parser.add_argument("--output-dir", type=Path, default=None, help="default: runs/<recipe name>")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--save-steps", type=int, default=None, help="checkpoint every N steps (overrides the recipe)")
    parser.add_argument("--resume", nargs="?", const="latest", default=None, metavar="latest|auto|PATH",
                        help="resume from the latest verified checkpoint of --output-dir (auto: if there is one), or PATH")
    parser.add_argument("--gpus", type=int, default=None,
                        help="processes of this launch, overriding cluster.gpus (e.g. resuming at another world size)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    add_plan_flags(parser, overriding="the recipe's plan")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except UserInputError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    finally:
        _destroy_process_group()


def _run(args: argparse.Namespace) -> int:
    from toolkit.planner.recipe import recipe_plan
    from toolkit.spec.recipe import load_recipe, recipe_model

    for flag, value in (("--max-steps", args.max_steps), ("--save-steps", args.save_steps), ("--gpus", args.gpus)):
        if value is not None and value < 1:
            raise UserInputError(flag, f"must be positive, got {value}")
    recipe = load_recipe(args.recipe)
    if args.gpus is not None:
        cluster = {"gpus": args.gpus, "gpus_per_node": min(args.gpus, recipe.cluster.gpus_per_node)}
        recipe = recipe.model_copy(update={"cluster": recipe.cluster.model_copy(update=cluster)})
    updates = {k: v for k, v in (("max_steps", args.max_steps), ("save_steps", args.save_steps)) if v is not None}
    if updates:  # the schedule, the DeepSpeed config and the trainer arguments must all see the new values
        recipe = recipe.model_copy(update={"training": recipe.training.model_copy(update=updates)})
    model = recipe_model(recipe)
    plan = recipe_plan(recipe, model, **plan_overrides(args))
    output_dir = args.output_dir or Path("runs") / recipe.name
    if plan.backend == "megatron":  # issue 5: Megatron-Core backend (toolkit/backends/megatron_core.py)
        if args.deepspeed:
            raise UserInputError("--deepspeed", "is a DeepSpeed option; the megatron backend builds megatron.yaml")
        from toolkit.backends.megatron_core import train as train_megatron

        summary = train_megatron(recipe, model, plan, output_dir, args.resume)
        logging.getLogger("toolkit.train").info("done: %s", summary)
        return 0
    from toolkit.backends.hf_trainer import train

    summary = train(recipe, model, plan, output_dir, args.deepspeed, args.resume)
    logging.getLogger("toolkit.train").info("done: %s", summary)
    return 0


def _destroy_process_group() -> None:
    """gloo can abort at interpreter exit if the group is still alive; end it explicitly."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # best effort at shutdown
        pass


if __name__ == "__main__":
    raise SystemExit(main())
