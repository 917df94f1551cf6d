"""An fsdp plan as Accelerate's FSDP2 config (accelerate.yaml's fsdp_config) and as the HF Trainer's fsdp arguments
(trainer_args.json), both written from one table, so the two files agree by construction.

Keys are Accelerate's: `accelerate launch` copies every `fsdp_config.fsdp_*` to its flag of the same name and from
there to the FSDP_* variables FullyShardedDataParallelPlugin reads; the Trainer reads the same settings from
`fsdp_config` without the prefix (TrainingArguments._process_fsdp_args), except where its names differ
(`cpu_offload`, `transformer_layer_cls_to_wrap` as a list, `version`).
"""

from __future__ import annotations

from functools import lru_cache

from toolkit.compat.transformers_seams import no_split_modules
from toolkit.errors import UserInputError
from toolkit.generate.parallelism import yaml_section
from toolkit.spec.plan import Plan
from toolkit.spec.quantization import accelerate_fp8_config
from toolkit.spec.recipe import Recipe

# Accelerate's mixed_precision of each plan precision (the Trainer's bf16 / fp16 flags say the same; for fp8 both stay
# false, so the Trainer keeps the ACCELERATE_MIXED_PRECISION `accelerate launch` sets, TrainingArguments.__post_init__)
MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no", "fp8": "fp8"}
STATE_DICT_TYPE = "SHARDED_STATE_DICT"  # DCP checkpoints, one file per rank: pytorch_model_fsdp_0/, optimizer_0/


# accelerate.yaml's fsdp_config key -> the Trainer's fsdp_config key, for every setting the toolkit writes
SETTING_KEYS = {
    "fsdp_version": "version",
    "fsdp_auto_wrap_policy": "auto_wrap_policy",
    "fsdp_transformer_layer_cls_to_wrap": "transformer_layer_cls_to_wrap",  # comma list / list
    "fsdp_reshard_after_forward": "reshard_after_forward",
    "fsdp_offload_params": "cpu_offload",
    "fsdp_state_dict_type": "state_dict_type",
    "fsdp_cpu_ram_efficient_loading": "cpu_ram_efficient_loading",
    "fsdp_activation_checkpointing": "activation_checkpointing",  # FSDP's own, not the Trainer's
}


def fsdp_settings(plan: Plan, layer_classes: list[str]) -> dict:
    """accelerate.yaml's fsdp_config of a plan (the Trainer's is the same under SETTING_KEYS' names)."""
    return {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": ",".join(layer_classes),
        "fsdp_reshard_after_forward": plan.reshard_after_forward,
        "fsdp_offload_params": plan.offload_params == "cpu",
        "fsdp_state_dict_type": STATE_DICT_TYPE,
        # every rank builds (or loads) the model itself; rank-0 loading is for pretrained weights on big models
        "fsdp_cpu_ram_efficient_loading": False,
        "fsdp_activation_checkpointing": plan.recompute == "full",
    }


def trainer_fsdp_config(settings: dict) -> dict:
    """An accelerate.yaml fsdp_config under the Trainer's names (the layer classes as a list)."""
    config = {SETTING_KEYS[key]: value for key, value in settings.items() if key in SETTING_KEYS}
    if isinstance(config.get("transformer_layer_cls_to_wrap"), str):
        config["transformer_layer_cls_to_wrap"] = config["transformer_layer_cls_to_wrap"].split(",")
    return config


# torch context parallel's exchange of keys and values (Accelerate's TorchContextParallelConfig default: all-gather)
CP_COMM_STRATEGY = "allgather"


def parallelism_sizes(plan: Plan) -> dict | None:
    """Accelerate's ParallelismConfig arguments where a 1-D FSDP mesh over every rank is not the plan (HSDP, TP, torch
    context parallel over cp ranks, which FSDP2 shards over together with dp_shard)."""
    if plan.dp_replicate == 1 and plan.tp == 1 and plan.cp == 1:
        return None
    sizes = {"dp_replicate_size": plan.dp_replicate, "dp_shard_size": plan.dp_shard, "tp_size": plan.tp,
             "cp_size": plan.cp}
    if plan.cp > 1:
        sizes.update(cp_backend="torch", cp_comm_strategy=CP_COMM_STRATEGY)
    return sizes


def accelerate_fsdp_config(recipe: Recipe, plan: Plan, layer_classes: list[str]) -> dict:
    """accelerate.yaml for `accelerate launch`: distributed_type FSDP, fsdp_config, mixed precision and, for HSDP or
    TP, parallelism_config (keys as `accelerate config` writes them)."""
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "fsdp_config": fsdp_settings(plan, layer_classes),
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": MIXED_PRECISION[plan.precision],
        "num_machines": recipe.cluster.num_nodes,
        "num_processes": plan.gpus,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": recipe.cluster.accelerator == "cpu",
    }
    fp8 = accelerate_fp8_config(plan)
    if fp8:
        config["fp8_config"] = fp8
    sizes = parallelism_sizes(plan)
    if sizes:
        config["parallelism_config"] = yaml_section(sizes)
    return config


def trainer_fsdp_arguments(plan: Plan, layer_classes: list[str]) -> dict:
    """The TrainingArguments that make the HF Trainer build the same FSDP2 plugin (under torchrun as well as under
    `accelerate launch`). Gradient accumulation reduce-scatters every micro-batch (`sync_each_batch`): under
    Accelerate's no_sync FSDP2 would keep every rank's whole unsharded gradient until the last micro-batch
    (toolkit/backends/fsdp/memory.py). `parallelism_config` holds ParallelismConfig's keyword arguments."""
    args = {
        "fsdp": True,
        "fsdp_config": trainer_fsdp_config(fsdp_settings(plan, layer_classes)),
        "activation_checkpointing": False,  # FSDP checkpoints the layers itself (fsdp_config.activation_checkpointing)
        "accelerator_config": {"gradient_accumulation_kwargs": {"sync_each_batch": True}},
    }
    sizes = parallelism_sizes(plan)
    if sizes:
        args["parallelism_config"] = sizes
    return args


@lru_cache(maxsize=None)
def _no_split_modules(model_type: str) -> tuple[str, ...]:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    model_class = getattr(transformers, name, None) if name else None
    if model_class is None:
        raise UserInputError("model", f"transformers has no causal LM for model_type {model_type!r}: FSDP2 needs its "
                                      f"decoder layer class to wrap")
    return no_split_modules(model_class)


def decoder_layer_classes(hf_config: dict) -> list[str]:
    """The classes FSDP2 wraps one by one: the model class's `_no_split_modules` (what Accelerate falls back to when
    the config names none), written out so the files say what is sharded."""
    classes = list(_no_split_modules(str(hf_config.get("model_type"))))
    if not classes:
        raise UserInputError("model", f"{hf_config.get('model_type')}: the transformers model names no decoder layer "
                                      f"class (_no_split_modules) to wrap with FSDP2")
    return classes
