"""An Accelerate FSDP config (accelerate.yaml) checked before launching: Accelerate's own config loader, plugin and
ParallelismConfig classes, plus what they only hit at launch or never say: FSDP1 keys in an FSDP2 config (ignored
or refused), both FSDP's and the Trainer's activation checkpointing, mixed precision or FSDP settings that the
trainer arguments contradict, parallel sizes that do not multiply to the world size, unknown or misspelt keys.
"""

from __future__ import annotations

import contextlib
import difflib
import os
from functools import lru_cache

from toolkit.compat.stdlib_seams import parser_actions
from toolkit.generate.fsdp import SETTING_KEYS, trainer_fsdp_config
from toolkit.generate.parallelism import from_yaml_section, parallelism_config
from toolkit.validate import Problem

# FSDP1 keys, and what FSDP2 (fsdp_version 2) does instead (accelerate/utils/dataclasses.py
# FullyShardedDataParallelPlugin.__post_init__ drops, warns about or refuses each)
FSDP1_ONLY = {
    "fsdp_sharding_strategy": "FSDP2 says it with fsdp_reshard_after_forward (true: FULL_SHARD, false: SHARD_GRAD_OP)",
    "fsdp_backward_prefetch": "FSDP2 prefetches the next group by itself; remove it",
    "fsdp_forward_prefetch": "FSDP2 refuses it (not implemented); remove it",
    "fsdp_use_orig_params": "FSDP2 always trains the original parameters; remove it",
    "fsdp_sync_module_states": "FSDP2 needs no broadcast of module states; remove it",
}
TRAINER_CHECKPOINTING = ("activation_checkpointing", "gradient_checkpointing")  # transformers 5's name, the former
TRAINER_PRECISION = {"bf16": "bf16", "fp16": "fp16"}


@lru_cache(maxsize=1)
def _launch_keys() -> tuple[frozenset, frozenset]:
    """The fsdp_* and parallelism_config_* keys `accelerate launch` takes from a config file (its own flags)."""
    from accelerate.commands.launch import launch_command_parser

    dests = {action.dest for action in parser_actions(launch_command_parser())}
    return (frozenset(d for d in dests if d.startswith("fsdp_")),
            frozenset(d for d in dests if d.startswith("parallelism_config_")))


def _unknown(key: str, where: str, known, fix: str = "remove it") -> Problem:
    close = difflib.get_close_matches(key, list(known), n=1)
    return Problem(f"{where}{key}", "is not a key Accelerate reads here; " +
                   (f"did you mean '{close[0]}'?" if close else fix))


def _flag(value) -> bool | None:
    """A YAML true/false as Accelerate's str_to_bool reads it; None when it is neither."""
    text = str(value).lower()
    return True if text in ("true", "1", "yes", "y", "on") else False if text in ("false", "0", "no", "n", "off") \
        else None


def _accelerate_keys(config: dict) -> tuple[list[Problem], str]:
    """(the keys Accelerate's ClusterConfig does not have, the distributed_type) of an accelerate.yaml mapping."""
    from accelerate.commands.config.config_args import ClusterConfig

    fields = ClusterConfig.__dataclass_fields__
    return ([_unknown(key, "", fields, "remove it") for key in config if key not in fields],
            str(config.get("distributed_type", "(absent)")))


def validate_accelerate_fsdp(config: dict, world_size: int, trainer: dict | None = None) -> list[Problem]:
    """Every problem of an accelerate.yaml for FSDP2 (and of the trainer arguments beside it), all at once."""
    if not isinstance(config, dict):
        return [Problem("accelerate.yaml", "must be a mapping of Accelerate config keys")]
    problems, kind = _accelerate_keys(config)
    if kind != "FSDP":
        return problems + [Problem("distributed_type", f"is {kind}, not FSDP: this checks FSDP configs "
                                                       f"(a DeepSpeed one: validate the JSON its deepspeed_config "
                                                       f"names)")]
    fsdp = config.get("fsdp_config") or {}
    if not isinstance(fsdp, dict):
        return problems + [Problem("fsdp_config", "must be a mapping of fsdp_* keys")]
    fsdp = {(key if key.startswith("fsdp_") else f"fsdp_{key}"): value for key, value in fsdp.items()}
    problems += _fsdp_keys(fsdp)
    problems += _sizes(config, world_size)
    problems += _fp8(config)
    if trainer is not None:
        problems += _against_trainer(config, fsdp, trainer)
    if not problems:
        problems += _plugin(fsdp)
    return problems


def validate_accelerate_deepspeed(config: dict, world_size: int, trainer: dict | None = None) -> list[Problem]:
    """An accelerate.yaml for `accelerate launch` of DeepSpeed under HF Trainer: Accelerate's keys with distributed_type
    DEEPSPEED and the job's process count."""
    if not isinstance(config, dict):
        return [Problem("accelerate.yaml", "must be a mapping of Accelerate config keys")]
    problems, kind = _accelerate_keys(config)
    if kind != "DEEPSPEED":
        problems.append(Problem("distributed_type", f"is {kind}; the deepspeed backend launches with DEEPSPEED "
                                                    f"(regenerate it with `dmt generate`)"))
    problems += _sizes(config, world_size, fsdp=False)
    if "mixed_precision" in config and (config.get("deepspeed_config") or {}).get("deepspeed_config_file"):
        problems.append(Problem("mixed_precision", "is refused by Accelerate beside deepspeed_config_file "
                                                   "(DeepSpeedPlugin); say the precision in the DeepSpeed JSON"))
    problems += _fp8(config)
    if trainer is not None:
        problems += _parallelism_against_trainer(config, trainer)
    return problems


def _fp8(config: dict) -> list[Problem]:
    """accelerate.yaml's fp8_config against Accelerate's own recipe dataclasses (TERecipeKwargs, AORecipeKwargs,
    accelerate/utils/dataclasses.py): `accelerate launch` turns each key into ACCELERATE_FP8_<KEY>, and a key the
    recipe's dataclass has no field for is dropped without a word. The classes are read, not built: building one needs
    Transformer Engine or torchao installed, which the training machine has and this one need not."""
    import dataclasses
    from typing import get_args

    from accelerate.utils.dataclasses import AmaxComputeAlgorithm, AORecipeKwargs, FP8Format, TERecipeKwargs

    section = config.get("fp8_config")
    mixed = str(config.get("mixed_precision") or "no")
    if not section:
        return [Problem("fp8_config", "is missing: mixed_precision fp8 needs its backend (TE or AO)")] \
            if mixed == "fp8" else []
    if not isinstance(section, dict):
        return [Problem("fp8_config", "must be a mapping (backend: TE or AO, and that recipe's keys)")]
    if mixed != "fp8":
        return [Problem("fp8_config", f"is read only with mixed_precision fp8 (it is {mixed}); remove it")]
    kinds = {"TE": TERecipeKwargs, "AO": AORecipeKwargs}
    backend = str(section.get("backend", "")).upper()
    if backend not in kinds:
        return [Problem("fp8_config.backend", f"is {section.get('backend')!r}; the toolkit's recipes run TE "
                                              f"(Transformer Engine) or AO (torchao)")]
    known = {f.name for f in dataclasses.fields(kinds[backend]) if f.name != "config"} | {"backend"}
    problems = [_unknown(key, "fp8_config.", known, f"{backend} reads {', '.join(sorted(known))}") for key in section
                if key.removeprefix("fp8_") not in known and key not in known]
    for key, allowed in (("fp8_format", FP8Format), ("amax_compute_algo", AmaxComputeAlgorithm)):
        if key in section and str(section[key]).upper() not in {str(v).upper() for v in get_args(allowed)}:
            problems.append(Problem(f"fp8_config.{key}", f"is {section[key]!r}; Accelerate takes "
                                                         f"{', '.join(get_args(allowed))}"))
    return problems


def _fsdp_keys(fsdp: dict) -> list[Problem]:
    from accelerate.utils.constants import FSDP2_STATE_DICT_TYPE, FSDP_AUTO_WRAP_POLICY

    known, _ = _launch_keys()
    problems = [_unknown(key, "fsdp_config.", known) for key in fsdp if key not in known]
    version = str(fsdp.get("fsdp_version", "1"))
    if version != "2":
        return problems + [Problem("fsdp_config.fsdp_version", f"is {version}: the toolkit trains FSDP2 (fully_shard); "
                                                               f"set 2 (FSDP1 is deprecated in transformers)")]
    problems += [Problem(f"fsdp_config.{key}", f"is an FSDP1 option: {why}") for key, why in FSDP1_ONLY.items()
                 if key in fsdp]
    for key in ("fsdp_reshard_after_forward", "fsdp_offload_params", "fsdp_activation_checkpointing",
                "fsdp_activation_checkpointing_offload", "fsdp_cpu_ram_efficient_loading"):
        if key in fsdp and _flag(fsdp[key]) is None:
            problems.append(Problem(f"fsdp_config.{key}", f"is {fsdp[key]!r}; FSDP2 takes true or false"))
    policy = fsdp.get("fsdp_auto_wrap_policy")
    if policy is not None and str(policy).upper() not in FSDP_AUTO_WRAP_POLICY:
        problems.append(Problem("fsdp_config.fsdp_auto_wrap_policy", f"is {policy!r}; valid: "
                                                                     f"{', '.join(FSDP_AUTO_WRAP_POLICY)}"))
    state_dict = fsdp.get("fsdp_state_dict_type")
    if state_dict is not None and str(state_dict).upper() not in FSDP2_STATE_DICT_TYPE:
        problems.append(Problem("fsdp_config.fsdp_state_dict_type", f"is {state_dict!r}; FSDP2 saves "
                                                                    f"{' or '.join(FSDP2_STATE_DICT_TYPE)}"))
    return problems


def parallel_sizes(config: dict) -> dict[str, int]:
    """dp_replicate / dp_shard / tp / cp / sp sizes of parallelism_config (1 where absent; dp_shard: every process)."""
    section = config.get("parallelism_config") or {}
    sizes = {name: section.get(f"parallelism_config_{name}_size", 1) for name in ("dp_replicate", "tp", "cp", "sp")}
    sizes["dp_shard"] = section.get("parallelism_config_dp_shard_size", None)
    return sizes


def _sizes(config: dict, world_size: int, fsdp: bool = True) -> list[Problem]:
    problems = []
    processes = config.get("num_processes")
    if processes is not None and (isinstance(processes, bool) or not isinstance(processes, int)):
        # "2" would print as 2 in the line below, beside the 2 it is not equal to
        problems.append(Problem("num_processes", f"is {processes!r}, a {type(processes).__name__}; write the "
                                                 f"integer {world_size} (the processes the job launches)"))
    elif processes is not None and processes != world_size:
        problems.append(Problem("num_processes", f"is {processes} but the job launches {world_size} processes"))
    section = config.get("parallelism_config")
    if not section:
        return problems
    if not isinstance(section, dict):
        return problems + [Problem("parallelism_config", "must be a mapping of parallelism_config_* keys")]
    _, known = _launch_keys()
    problems += [_unknown(key, "parallelism_config.", known) for key in section if key not in known]
    sizes = parallel_sizes(config)
    bad = [name for name, size in sizes.items() if not isinstance(size, int) or isinstance(size, bool) or size < 1]
    if bad:
        return problems + [Problem(f"parallelism_config.parallelism_config_{bad[0]}_size", "must be a positive "
                                                                                           "integer")]
    total = sizes["dp_replicate"] * sizes["dp_shard"] * sizes["tp"] * sizes["cp"] * sizes["sp"]
    if total != world_size:
        named = "dp_replicate x dp_shard x tp x cp" + (" x sp" if sizes["sp"] > 1 else "")
        values = " x ".join(str(sizes[name]) for name in named.split(" x "))
        problems.append(Problem("parallelism_config", f"{named} = {values} = {total}, the world size is {world_size}"))
    if fsdp and sizes["dp_shard"] == 1 and sizes["cp"] == 1:  # accelerate/parallelism_config.py _validate_accelerator
        problems.append(Problem("parallelism_config.parallelism_config_dp_shard_size",
                                "is 1: FSDP has no dimension to shard across (Accelerate refuses it at launch); "
                                "shard over at least 2 ranks"))
    if not fsdp and sizes["cp"] > 1:  # accelerate/state.py: cp_size > 1 needs an FSDP2 plugin
        problems.append(Problem("parallelism_config.parallelism_config_cp_size",
                                f"is {sizes['cp']}: torch context parallel runs under FSDP2 only (Accelerate refuses "
                                f"it without an fsdp_plugin); with DeepSpeed use parallelism_config_sp_size (Ulysses)"))
    problems += _library_config(section)
    return problems


def _library_config(section: dict) -> list[Problem]:
    """Accelerate's own ParallelismConfig (and its sequence- or context-parallel handler) built from the section."""
    with _environment_kept():  # the classes read PARALLELISM_CONFIG_* variables for what is not given
        for name in [n for n in os.environ if n.startswith("PARALLELISM_CONFIG_")]:
            del os.environ[name]
        try:
            parallelism_config(from_yaml_section(section))
        except (ValueError, TypeError) as exc:
            return [Problem("parallelism_config", f"Accelerate's ParallelismConfig refuses it: "
                                                  f"{str(exc).splitlines()[0]}")]
    return []


def _against_trainer(config: dict, fsdp: dict, trainer: dict) -> list[Problem]:
    """What the HF Trainer would do differently from the YAML: it builds its own FSDP plugin from its arguments."""
    problems = []
    precision = "bf16" if trainer.get("bf16") else "fp16" if trainer.get("fp16") else "no"
    mixed = str(config.get("mixed_precision") or "no")
    if mixed != precision and not (mixed == "fp8" and precision == "no"):  # fp8: the Trainer keeps Accelerate's
        problems.append(Problem("mixed_precision", f"is {mixed} but the trainer arguments train in {precision} "
                                                   f"(bf16/fp16); make them the same"))
    checkpointing = next((key for key in TRAINER_CHECKPOINTING if trainer.get(key)), None)
    if checkpointing and _flag(fsdp.get("fsdp_activation_checkpointing")):
        problems.append(Problem("fsdp_config.fsdp_activation_checkpointing",
                                f"and the trainer arguments' {checkpointing} are both on; the Trainer refuses both: "
                                f"keep FSDP's and set {checkpointing} false"))
    if not trainer.get("fsdp"):
        return problems + [Problem("trainer_args.fsdp", "is not set: the Trainer would not build the FSDP plugin "
                                                        "this accelerate.yaml describes")]
    expected = trainer_fsdp_config({key: value for key, value in fsdp.items() if key in SETTING_KEYS})
    stated = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in (trainer.get("fsdp_config") or {}).items()}
    for key, value in expected.items():
        if _normal(stated.get(key)) != _normal(value):
            yaml_key = next(k for k, v in SETTING_KEYS.items() if v == key)
            problems.append(Problem(f"trainer_args.fsdp_config.{key}", f"is {stated.get(key)!r} but accelerate.yaml's "
                                                                       f"{yaml_key} is {value!r}; make them the same"))
    return problems + _parallelism_against_trainer(config, trainer)


def _parallelism_against_trainer(config: dict, trainer: dict) -> list[Problem]:
    """The Trainer builds its Accelerator from trainer_args' parallelism_config: it must say what accelerate.yaml says."""
    sizes = {f"{name}_size": size for name, size in parallel_sizes(config).items()}
    stated = {**sizes, **from_yaml_section(config.get("parallelism_config") or {})}
    theirs = trainer.get("parallelism_config") or {}
    if (config.get("parallelism_config") or theirs) and any(theirs.get(k, 1 if k in sizes else None) != v
                                                            for k, v in stated.items() if v is not None):
        return [Problem("trainer_args.parallelism_config", f"is {theirs or 'absent'} but accelerate.yaml's "
                                                           f"parallelism_config gives {stated}; make them the same")]
    return []


def _normal(value):
    """A setting as both files may spell it: true / "true", 2 / "2", a list or a comma list."""
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    if isinstance(value, bool) or str(value).lower() in ("true", "false"):
        return _flag(value)
    return str(value)


def _plugin(fsdp: dict) -> list[Problem]:
    """Accelerate's FullyShardedDataParallelPlugin built from the file, as `accelerate launch` would hand it over."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    arguments = {"fsdp_version": 2, "reshard_after_forward": fsdp.get("fsdp_reshard_after_forward", True),
                 "cpu_offload": bool(_flag(fsdp.get("fsdp_offload_params", False))),
                 "auto_wrap_policy": fsdp.get("fsdp_auto_wrap_policy", "NO_WRAP"),
                 "transformer_cls_names_to_wrap": fsdp.get("fsdp_transformer_layer_cls_to_wrap"),
                 "state_dict_type": fsdp.get("fsdp_state_dict_type", "SHARDED_STATE_DICT"),
                 "activation_checkpointing": bool(_flag(fsdp.get("fsdp_activation_checkpointing", False))),
                 "activation_checkpointing_offload": bool(_flag(fsdp.get("fsdp_activation_checkpointing_offload",
                                                                         False))),
                 "cpu_ram_efficient_loading": bool(_flag(fsdp.get("fsdp_cpu_ram_efficient_loading", False)))}
    with _environment_kept():  # the plugin reads and writes FSDP_* variables
        try:
            FullyShardedDataParallelPlugin(**arguments)
        except (ValueError, TypeError, KeyError) as exc:
            return [Problem("fsdp_config", f"Accelerate's FullyShardedDataParallelPlugin refuses it: "
                                           f"{str(exc).splitlines()[0]}")]
    return []


@contextlib.contextmanager
def _environment_kept():
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def accelerate_plan_view(config: dict) -> dict[str, tuple[str, object]]:
    """The plan options an accelerate.yaml (FSDP2's, or DeepSpeed's with Ulysses) states: option -> (its key, its
    value)."""
    fsdp = {(k if k.startswith("fsdp_") else f"fsdp_{k}"): v for k, v in (config.get("fsdp_config") or {}).items()}
    precisions = {"bf16": "bf16", "fp16": "fp16", "no": "fp32", "fp8": "fp8"}
    view = {"backend": ("distributed_type", "fsdp" if config.get("distributed_type") == "FSDP" else
                        str(config.get("distributed_type")).lower()),
            "gpus": ("num_processes", config.get("num_processes"))}
    if str(config.get("mixed_precision")) in precisions:
        view["precision"] = ("mixed_precision", precisions[str(config["mixed_precision"])])
    for name, key, convert in (("reshard_after_forward", "fsdp_reshard_after_forward", _flag),
                               ("offload_params", "fsdp_offload_params", lambda v: "cpu" if _flag(v) else "none"),
                               ("recompute", "fsdp_activation_checkpointing",
                                lambda v: "full" if _flag(v) else "none")):
        if key in fsdp:
            view[name] = (f"fsdp_config.{key}", convert(fsdp[key]))
    if config.get("parallelism_config"):
        sizes = parallel_sizes(config)
        # under DeepSpeed, ZeRO's data-parallel ranks are Accelerate's dp_shard ones (no FSDP2 shard groups)
        options = {"dp_shard": "dp", "sp": "sp"} if config.get("distributed_type") == "DEEPSPEED" else \
            {name: name for name in ("dp_replicate", "dp_shard", "tp", "cp")}
        for name, option in options.items():
            view[option] = (f"parallelism_config.parallelism_config_{name}_size", sizes[name])
    return {name: (key, value) for name, (key, value) in view.items() if value is not None}
