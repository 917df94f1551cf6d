"""The `accelerate launch --config_file` YAML of a plan (DeepSpeed through Accelerate)."""

from __future__ import annotations

from toolkit.spec.plan import Plan
from toolkit.spec.recipe import Recipe


def accelerate_config(recipe: Recipe, plan: Plan, deepspeed_json: str) -> dict:
    """Accelerate refuses `mixed_precision` next to a deepspeed_config_file: precision lives in the DeepSpeed JSON."""
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": deepspeed_json, "zero3_init_flag": plan.zero == 3},
        "machine_rank": 0,
        "main_training_function": "main",
        "num_machines": recipe.cluster.num_nodes,
        "num_processes": plan.gpus,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": recipe.cluster.accelerator == "cpu",
    }
