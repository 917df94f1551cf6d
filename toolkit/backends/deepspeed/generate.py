"""What `dmt generate` writes for a DeepSpeed plan: deepspeed.json, the accelerate.yaml that launches it and the HF
TrainingArguments that point at it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolkit.numeric import json_text, yaml_text

if TYPE_CHECKING:
    from toolkit.generate.files import GenerationContext
    from toolkit.spec.plan import Plan
    from toolkit.spec.recipe import Recipe


def _deepspeed(ctx: GenerationContext) -> str:
    from toolkit.generate.deepspeed import deepspeed_config

    return json_text(deepspeed_config(ctx.plan, ctx.recipe.training, ctx.recipe.deepspeed), indent=2) + "\n"


def _accelerate(ctx: GenerationContext) -> str:
    from toolkit.generate.accelerate import accelerate_config

    return yaml_text(accelerate_config(ctx.recipe, ctx.plan, str(ctx.out_dir / "deepspeed.json")), sort_keys=False)


def _trainer_args(ctx: GenerationContext) -> str:
    from toolkit.generate.trainer_args import trainer_arguments

    args = trainer_arguments(ctx.recipe, ctx.plan, str(ctx.out_dir / "run"), str(ctx.out_dir / "deepspeed.json"))
    return json_text(args, indent=2) + "\n"


WRITERS = {"deepspeed.json": _deepspeed, "accelerate.yaml": _accelerate, "trainer_args.json": _trainer_args}


def trainer_extras(recipe: Recipe, plan: Plan) -> dict:
    """TrainingArguments of this backend beyond the common ones: none (deepspeed.json holds DeepSpeed's)."""
    return {}


def launch_variables(plan: Plan) -> dict[str, tuple[str, str]]:
    """Environment variables a launch of this plan sets (name -> value, reason): none."""
    return {}
