"""What `dmt generate` writes for a Megatron-Core plan: megatron.yaml (what the toolkit's loop builds from) and the
same settings as Megatron-LM's pretrain_gpt.py flags."""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolkit.generate.megatron import megatron_config, megatron_yaml
from toolkit.generate.megatron_args import megatron_args_text
from toolkit.spec.recipe import recipe_hf_config

if TYPE_CHECKING:
    from toolkit.generate.files import GenerationContext
    from toolkit.spec.plan import Plan


def _config(ctx: GenerationContext) -> dict:
    return megatron_config(ctx.recipe, ctx.model, ctx.plan, recipe_hf_config(ctx.recipe))


def _megatron_yaml(ctx: GenerationContext) -> str:
    return megatron_yaml(_config(ctx), ctx.recipe.name)


def _megatron_args(ctx: GenerationContext) -> str:
    return megatron_args_text(_config(ctx), ctx.recipe.name)


WRITERS = {"megatron.yaml": _megatron_yaml, "megatron_args.txt": _megatron_args}
trainer_extras = None  # it trains no HF Trainer: no trainer_args.json


def launch_variables(plan: Plan) -> dict[str, tuple[str, str]]:
    """Environment variables a launch of this plan sets (name -> value, reason): Megatron-LM and Megatron-Core's
    TP/CP communication overlap expect one CUDA connection per device, so kernels queue in issue order (Megatron-LM's
    validate_args asserts it with TP or CP)."""
    if plan.tp > 1 or plan.cp > 1:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": ("1", "Megatron-Core TP/CP: kernels queue in issue order")}
    return {}
