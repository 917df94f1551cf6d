"""What `dmt generate` writes for an FSDP2 plan: Accelerate's FSDP2 config and the HF TrainingArguments that build the
same plugin under torchrun."""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolkit.generate.fsdp import accelerate_fsdp_config, decoder_layer_classes, trainer_fsdp_arguments
from toolkit.generate.trainer_args import trainer_arguments
from toolkit.numeric import json_text, yaml_text
from toolkit.spec.recipe import recipe_hf_config

if TYPE_CHECKING:
    from toolkit.generate.files import GenerationContext
    from toolkit.spec.plan import Plan
    from toolkit.spec.recipe import Recipe


def _accelerate(ctx: GenerationContext) -> str:
    config = accelerate_fsdp_config(ctx.recipe, ctx.plan, decoder_layer_classes(recipe_hf_config(ctx.recipe)))
    return yaml_text(config, sort_keys=False)


def _trainer_args(ctx: GenerationContext) -> str:
    return json_text(trainer_arguments(ctx.recipe, ctx.plan, str(ctx.out_dir / "run"), None), indent=2) + "\n"


WRITERS = {"accelerate.yaml": _accelerate, "trainer_args.json": _trainer_args}


def trainer_extras(recipe: Recipe, plan: Plan) -> dict:
    """TrainingArguments of this backend beyond the common ones: the FSDP2 plugin's (fsdp, fsdp_config)."""
    return trainer_fsdp_arguments(plan, decoder_layer_classes(recipe_hf_config(recipe)))


def launch_variables(plan: Plan) -> dict[str, tuple[str, str]]:
    """Environment variables a launch of this plan sets (name -> value, reason): none."""
    return {}
