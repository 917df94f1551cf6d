"""Accelerate's ParallelismConfig as the generated files spell it: one flat dict of its keyword arguments (the sizes,
backends and their handlers' fields), written under `parallelism_config_*` keys in accelerate.yaml (what
`accelerate launch` reads) and as is in trainer_args.json, and built back into the library's own class by training
and by `dmt validate`. Each backend's generator says which sizes its plan needs (`parallelism_arguments`)."""

from __future__ import annotations

YAML_PREFIX = "parallelism_config_"
# the fields of Accelerate's handler classes (accelerate/utils/dataclasses.py), which the flat dict holds beside sizes
SP_HANDLER_FIELDS = ("sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation")
CP_HANDLER_FIELDS = ("cp_comm_strategy",)


def yaml_section(arguments: dict) -> dict:
    """accelerate.yaml's parallelism_config section of ParallelismConfig's arguments."""
    return {f"{YAML_PREFIX}{name}": value for name, value in arguments.items()}


def from_yaml_section(section: dict) -> dict:
    """ParallelismConfig's arguments from accelerate.yaml's parallelism_config section."""
    return {(key[len(YAML_PREFIX):] if key.startswith(YAML_PREFIX) else key): value for key, value in section.items()}


def parallelism_config(arguments: dict):
    """Accelerate's own ParallelismConfig (with its DeepSpeedSequenceParallelConfig / TorchContextParallelConfig
    handler) from the flat arguments; its own checks raise ValueError. Every size is given, so nothing is read from
    the PARALLELISM_CONFIG_* variables a launcher may have set."""
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig, TorchContextParallelConfig

    sizes = {key: value for key, value in arguments.items() if key not in SP_HANDLER_FIELDS + CP_HANDLER_FIELDS}
    for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
        sizes.setdefault(name, 1)
    sp_fields = {key: arguments[key] for key in SP_HANDLER_FIELDS if key in arguments}
    cp_fields = {key: arguments[key] for key in CP_HANDLER_FIELDS if key in arguments}
    if sizes["sp_size"] > 1:
        sizes["sp_handler"] = DeepSpeedSequenceParallelConfig(**sp_fields)
    if sizes["cp_size"] > 1:
        sizes["cp_handler"] = TorchContextParallelConfig(**cp_fields)
    return ParallelismConfig(**sizes)
