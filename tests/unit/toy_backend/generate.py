"""DDP's files: the HF TrainingArguments alone (torchrun starts the ranks, the Trainer wraps the model in DDP)."""

from toolkit.numeric import json_text


def _trainer_args(ctx):
    from toolkit.generate.trainer_args import trainer_arguments

    return json_text(trainer_arguments(ctx.recipe, ctx.plan, str(ctx.out_dir / "run"), None), indent=2) + "\n"


WRITERS = {"trainer_args.json": _trainer_args}


def trainer_extras(recipe, plan):
    return {}


def launch_variables(plan):
    return {}
