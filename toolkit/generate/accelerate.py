"""The `accelerate launch --config_file` YAML of a plan (DeepSpeed through Accelerate)."""

from __future__ import annotations

from toolkit.spec.plan import Plan
from toolkit.spec.recipe import Recipe


def accelerate_config(recipe: Recipe, plan: Plan, deepspeed_json: str) -> dict:
    """Accelerate refuses `mixed_precision` next to a deepspeed_config_file: precision lives in the DeepSpeed JSON.

    On several nodes each node runs `accelerate launch` itself (the `standard` multinode launcher, torchrun per node),
    with its rank and the rendezvous address on the command line that launch.sh writes."""
    nodes = recipe.cluster.num_nodes
    deepspeed = {"deepspeed_config_file": deepspeed_json, "zero3_init_flag": plan.zero == 3}
    if nodes > 1:
        deepspeed["deepspeed_multinode_launcher"] = "standard"
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": deepspeed,
        "machine_rank": 0,
        "main_training_function": "main",
        "num_machines": nodes,
        "num_processes": plan.gpus,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": recipe.cluster.accelerator == "cpu",
    }
