"""HF TrainingArguments against a DeepSpeed JSON: every value both state must agree, as HF Trainer checks at launch.

One table (`PAIRS`) serves both directions: it finds mismatches between explicit values, and it fills the DeepSpeed
values written as "auto" the way `transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig` does.
"""

from __future__ import annotations

import copy
import difflib
import math
from collections.abc import Callable
from pathlib import Path

from toolkit.generate.trainer_args import HF_OPTIMIZERS
from toolkit.validate import Problem

# DeepSpeed scheduler -> HF lr_scheduler_type values that describe the same schedule
SCHEDULER_KINDS = {
    "WarmupCosineLR": {"cosine", "cosine_with_min_lr"},
    "WarmupDecayLR": {"linear"},
    "WarmupLR": {"constant_with_warmup", "constant"},
}
# DeepSpeed optimizer type (lower case) -> prefix of the HF `optim` names that are the same algorithm
OPTIMIZER_KINDS = {"adamw": "adamw", "adam": "adam", "sgd": "sgd"}
BATCH_FACTORS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def trainer_defaults() -> dict:
    """TrainingArguments' field defaults: what HF uses for a key the file leaves out."""
    import dataclasses

    from transformers import TrainingArguments

    return {f.name: f.default for f in dataclasses.fields(TrainingArguments) if f.default is not dataclasses.MISSING}


def _warmup(hf: dict) -> int:
    """HF's warm-up steps (a float below 1 is a share of max_steps), at least 1 as HF hands it to DeepSpeed."""
    steps = hf["warmup_steps"]
    steps = steps if steps >= 1 else math.ceil(hf["max_steps"] * steps)
    return max(1, int(steps))


# (DeepSpeed dotted key, HF key(s) named in messages, the value HF derives for it)
PAIRS: list[tuple[str, str, Callable[[dict, int], object]]] = [
    ("train_micro_batch_size_per_gpu", "per_device_train_batch_size", lambda hf, dp: hf["per_device_train_batch_size"]),
    ("gradient_accumulation_steps", "gradient_accumulation_steps", lambda hf, dp: hf["gradient_accumulation_steps"]),
    ("train_batch_size", "per_device_train_batch_size x gradient_accumulation_steps x dp",
     lambda hf, dp: hf["per_device_train_batch_size"] * hf["gradient_accumulation_steps"] * dp),
    ("gradient_clipping", "max_grad_norm", lambda hf, dp: hf["max_grad_norm"]),
    ("bf16.enabled", "bf16", lambda hf, dp: bool(hf["bf16"])),
    ("fp16.enabled", "fp16", lambda hf, dp: bool(hf["fp16"])),
    ("optimizer.params.lr", "learning_rate", lambda hf, dp: hf["learning_rate"]),
    ("optimizer.params.betas", "adam_beta1, adam_beta2", lambda hf, dp: [hf["adam_beta1"], hf["adam_beta2"]]),
    ("optimizer.params.eps", "adam_epsilon", lambda hf, dp: hf["adam_epsilon"]),
    ("optimizer.params.weight_decay", "weight_decay", lambda hf, dp: hf["weight_decay"]),
    ("scheduler.params.total_num_steps", "max_steps", lambda hf, dp: hf["max_steps"]),
    ("scheduler.params.warmup_num_steps", "warmup_steps", lambda hf, dp: _warmup(hf)),
    ("scheduler.params.warmup_max_lr", "learning_rate", lambda hf, dp: hf["learning_rate"]),
    ("scheduler.params.cos_min_ratio", "lr_scheduler_kwargs.min_lr_rate",
     lambda hf, dp: (hf.get("lr_scheduler_kwargs") or {}).get("min_lr_rate")),
]


def _node(config: dict, dotted: str) -> tuple[dict | None, str]:
    *parents, leaf = dotted.split(".")
    node = config
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def auto_keys(config: dict) -> list[str]:
    """The dotted keys of the PAIRS table that hold "auto"."""
    found = []
    for dotted, _, _ in PAIRS:
        node, leaf = _node(config, dotted)
        if node is not None and node.get(leaf) == "auto":
            found.append(dotted)
    return found


def fill_auto(config: dict, trainer: dict | None, dp: int) -> dict:
    """A copy with every "auto" replaced by HF's value; without trainer arguments, by DeepSpeed's own default
    (the key is dropped), and the micro-batch by 1 so the rest can still be checked."""
    filled = copy.deepcopy(config)
    hf = {**trainer_defaults(), **trainer} if trainer is not None else None
    for dotted in auto_keys(config):
        node, leaf = _node(filled, dotted)
        if hf is not None:
            node[leaf] = next(derive for key, _, derive in PAIRS if key == dotted)(hf, dp)
        else:
            del node[leaf]
    if hf is None and "train_micro_batch_size_per_gpu" in auto_keys(config):
        filled["train_micro_batch_size_per_gpu"] = 1
    return filled


def _unknown_keys(trainer: dict) -> list[Problem]:
    fields = trainer_defaults().keys() | {"output_dir"}
    problems = []
    for key in trainer:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean '{close[0]}'?" if close else "remove it"
            problems.append(Problem(f"trainer_args.{key}", f"is not a TrainingArguments field; {hint}"))
    return problems


def _kind_problems(config: dict, hf: dict) -> list[Problem]:
    """DeepSpeed's optimizer and scheduler are the ones that run; trainer arguments that name another algorithm
    (HF ignores its own then) describe a different run. Only what the file states counts, not HF's defaults."""
    problems = []
    ds_optimizer = str(config.get("optimizer", {}).get("type", "")).lower()
    if ds_optimizer and "optim" in hf and not str(hf["optim"]).startswith(OPTIMIZER_KINDS.get(ds_optimizer, ds_optimizer)):
        problems.append(Problem("optimizer.type", f"{config['optimizer']['type']} in the DeepSpeed JSON but optim="
                                                  f"{hf['optim']} in the trainer arguments (DeepSpeed's wins); make "
                                                  f"them the same algorithm or drop the JSON's optimizer section"))
    ds_scheduler = config.get("scheduler", {}).get("type")
    kinds = SCHEDULER_KINDS.get(ds_scheduler)
    if kinds and "lr_scheduler_type" in hf and hf["lr_scheduler_type"] not in kinds:
        problems.append(Problem("scheduler.type", f"{ds_scheduler} in the DeepSpeed JSON but lr_scheduler_type="
                                                  f"{hf['lr_scheduler_type']} in the trainer arguments (DeepSpeed's "
                                                  f"wins); use lr_scheduler_type {' or '.join(sorted(kinds))}"))
    return problems


def trainer_problems(config: dict, trainer: dict, dp: int, config_path: Path | None = None) -> list[Problem]:
    """Every disagreement between the DeepSpeed JSON and the trainer arguments, all at once."""
    if not isinstance(trainer, dict):
        return [Problem("trainer_args", "the file must hold a JSON object of TrainingArguments keyword arguments")]
    problems = _unknown_keys(trainer)
    hf = {**trainer_defaults(), **trainer}
    if hf.get("bf16") and hf.get("fp16"):
        problems.append(Problem("trainer_args.bf16", "bf16 and fp16 are both true; set exactly one"))
    for dotted, hf_key, derive in PAIRS:
        node, leaf = _node(config, dotted)
        ds_value = node.get(leaf) if node is not None else None
        if ds_value is None or ds_value == "auto":
            continue
        if dotted == "scheduler.params.cos_min_ratio" and hf.get("lr_scheduler_type") != "cosine_with_min_lr":
            continue
        if dotted.startswith("optimizer.params.betas") and config.get("optimizer", {}).get("type", "").lower() == "sgd":
            continue
        if dotted == "train_batch_size" and any(p.key in BATCH_FACTORS for p in problems):
            continue  # a differing factor is the cause, already reported
        hf_value = derive(hf, dp)
        if hf_value is not None and ds_value != hf_value:
            problems.append(Problem(dotted, f"{ds_value} in the DeepSpeed JSON but {hf_key} gives {hf_value} in the "
                                            f"trainer arguments; make them equal (or set the DeepSpeed value to \"auto\")"))
    problems += _kind_problems(config, trainer)
    named = trainer.get("deepspeed")
    if config_path is not None and isinstance(named, str) and Path(named).resolve() != Path(config_path).resolve():
        problems.append(Problem("trainer_args.deepspeed", f"points at {named}, not at the validated {config_path}; "
                                                          f"point it at the file you launch with"))
    return problems


def trainer_plan_view(trainer: dict) -> dict[str, tuple[str, object]]:
    """The plan options HF TrainingArguments state: option -> (the key, its value), for the keys the dict holds."""
    view = {}
    for name, key in (("micro_batch", "per_device_train_batch_size"), ("grad_accum", "gradient_accumulation_steps")):
        if key in trainer:
            view[name] = (key, trainer[key])
    # neither flag: fp32, or under FSDP the mixed_precision Accelerate's launch sets (fp8 too, which the Trainer has no
    # flag for): there the accelerate.yaml beside it states the precision
    if trainer.get("bf16") or trainer.get("fp16") or ("bf16" in trainer or "fp16" in trainer) and not trainer.get("fsdp"):
        view["precision"] = ("bf16", "bf16" if trainer.get("bf16") else "fp16" if trainer.get("fp16") else "fp32")
    for key in ("activation_checkpointing", "gradient_checkpointing"):  # transformers 5's name, and the former one
        if key in trainer:
            view["recompute"] = (key, "full" if trainer[key] else "none")
    fsdp = trainer.get("fsdp_config") if trainer.get("fsdp") else None
    if isinstance(fsdp, dict):  # FSDP2 checkpoints layers itself; reshard and offload are its settings too
        stated = {"activation_checkpointing": ("recompute", lambda v: "full" if v else "none"),
                  "reshard_after_forward": ("reshard_after_forward", lambda v: v),
                  "cpu_offload": ("offload_params", lambda v: "cpu" if v else "none")}
        for key, (name, convert) in stated.items():
            if key in fsdp:
                view[name] = (f"fsdp_config.{key}", convert(fsdp[key]))
    optimizers = {hf: plan for plan, hf in HF_OPTIMIZERS.items()}
    if trainer.get("optim") in optimizers:
        view["optimizer"] = ("optim", optimizers[trainer["optim"]])
    return view
