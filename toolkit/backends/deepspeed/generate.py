"""What `dmt generate` writes for a DeepSpeed plan: deepspeed.json, the accelerate.yaml that launches it and the HF
TrainingArguments that point at it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolkit.generate.accelerate import accelerate_config
from toolkit.generate.deepspeed import deepspeed_config
from toolkit.generate.parallelism import yaml_section
from toolkit.generate.trainer_args import trainer_arguments
from toolkit.numeric import json_text, yaml_text

if TYPE_CHECKING:
    from toolkit.generate.files import GenerationContext
    from toolkit.spec.plan import Plan
    from toolkit.spec.recipe import Recipe


def _deepspeed(ctx: GenerationContext) -> str:
    return json_text(deepspeed_config(ctx.plan, ctx.recipe.training, ctx.recipe.deepspeed), indent=2) + "\n"


def _accelerate(ctx: GenerationContext) -> str:
    config = accelerate_config(ctx.recipe, ctx.plan, str(ctx.out_dir / "deepspeed.json"))
    arguments = parallelism_arguments(ctx.plan)
    if arguments:
        config["parallelism_config"] = yaml_section(arguments)
    return yaml_text(config, sort_keys=False)


def _trainer_args(ctx: GenerationContext) -> str:
    args = trainer_arguments(ctx.recipe, ctx.plan, str(ctx.out_dir / "run"), str(ctx.out_dir / "deepspeed.json"))
    return json_text(args, indent=2) + "\n"


WRITERS = {"deepspeed.json": _deepspeed, "accelerate.yaml": _accelerate, "trainer_args.json": _trainer_args}


def parallelism_arguments(plan: Plan) -> dict | None:
    """Accelerate's ParallelismConfig of a Ulysses plan (None without): sp_size ranks share each sequence, ZeRO
    shards over the dp data-parallel ranks (Accelerate sizes DeepSpeed's train_batch_size by them), attention runs
    the plan's kernels on each rank's heads. Sequence lengths may vary between batches (SFT rows do)."""
    if plan.sp == 1:
        return None
    return {"dp_replicate_size": 1, "dp_shard_size": plan.dp, "sp_size": plan.sp, "sp_backend": "deepspeed",
            "sp_seq_length_is_variable": True, "sp_attn_implementation": plan.attention}


def trainer_extras(recipe: Recipe, plan: Plan) -> dict:
    """TrainingArguments of this backend beyond the common ones (deepspeed.json holds DeepSpeed's): Ulysses'
    ParallelismConfig arguments."""
    arguments = parallelism_arguments(plan)
    return {"parallelism_config": arguments} if arguments else {}


def launch_variables(plan: Plan) -> dict[str, tuple[str, str]]:
    """Environment variables a launch of this plan sets (name -> value, reason): none."""
    return {}
