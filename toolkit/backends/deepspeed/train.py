"""Training a DeepSpeed plan: the HF Trainer with the generated deepspeed.json (toolkit/backends/hf_trainer.py), and
what DeepSpeed adds to it (DeepSpeedHooks): its config checked against the trainer arguments and this host, its
distributed init before the model (ZeRO-3 partitions at construction), a universal checkpoint to resume at another world
size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.backends.deepspeed.checkpoint import MANIFEST_FORMAT
from toolkit.backends.deepspeed.universal import universal_checkpoint
from toolkit.backends.hf_hooks import TrainerHooks, refuse_fp16_without_gpu
from toolkit.backends.hf_trainer import train  # noqa: F401 (the backend's entry, train.py calls it)
from toolkit.errors import UserInputError
from toolkit.generate.deepspeed import deepspeed_config
from toolkit.readers import read_json
from toolkit.runtime.ds_shm import release_at_exit
from toolkit.validate.deepspeed import validate_deepspeed_config

if TYPE_CHECKING:
    from toolkit.spec.plan import Plan
    from toolkit.spec.recipe import Recipe


def adapt_for_cpu(ds_config: dict) -> dict:
    """On CPU ranks DeepSpeed's fused CPU Adam would be compiled first; torch's AdamW does the same arithmetic."""
    config = json.loads(json.dumps(ds_config))
    params = config.get("optimizer", {}).get("params")
    if params is not None and config["optimizer"]["type"].lower() in ("adam", "adamw"):
        params["torch_adam"] = True
    return config


def deepspeed_config_of(recipe: Recipe, plan: Plan, path: str | None, generated: dict | None) -> dict:
    """The DeepSpeed config this run trains with: the generated file's (as plan.json's directory holds it), a file
    given with --deepspeed, or the generator's output for the recipe's plan."""
    if generated is not None:
        config = json.loads(json.dumps(generated))
    elif path:
        config = read_json(Path(path), "--deepspeed", what="a DeepSpeed JSON config")
        stage = (config.get("zero_optimization") or {}).get("stage", 0)
        if stage != plan.zero:  # the manifest, the memory model and resume all go by the plan's stage
            raise UserInputError("--deepspeed", f"zero_optimization.stage is {stage} in {path} but the plan says "
                                                f"{plan.zero}; pass --zero {stage} or regenerate the file")
    else:
        config = deepspeed_config(plan, recipe.training, recipe.deepspeed)
    return adapt_for_cpu(config) if recipe.cluster.accelerator == "cpu" else config


def _check_precision_runs_here(config: dict, trainer_args: dict) -> None:
    """DeepSpeed refuses an unsupported precision only after building the model; say so before, in one line."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if (config.get("fp16") or {}).get("enabled") in (True, "auto") and trainer_args.get("fp16"):
        refuse_fp16_without_gpu()
    for section, supported in (("fp16", accelerator.is_fp16_supported), ("bf16", accelerator.is_bf16_supported)):
        enabled = (config.get(section) or {}).get("enabled")
        if (enabled is True or (enabled == "auto" and trainer_args.get(section))) and not supported():
            raise UserInputError("plan.precision", f"{section} does not run on DeepSpeed's "
                                                   f"{accelerator.device_name()} accelerator; use bf16 or fp32 here")


class DeepSpeedHooks(TrainerHooks):
    accelerate_variable = "ACCELERATE_USE_DEEPSPEED"
    checkpoint_format = MANIFEST_FORMAT
    layout_keys = ("dp", "tp", "pp", "zero")

    def arguments(self, args_dict, recipe, plan, world, deepspeed_json, generated_deepspeed, resharded):
        """The DeepSpeed config into the trainer arguments, checked against them before DeepSpeed or HF find out
        mid-launch."""
        args_dict["deepspeed"] = deepspeed_config_of(recipe, plan, deepspeed_json, generated_deepspeed)
        if resharded:
            args_dict["deepspeed"].setdefault("checkpoint", {})["load_universal"] = True
        if deepspeed_json or generated_deepspeed is not None:
            problems = validate_deepspeed_config(args_dict["deepspeed"], world, trainer_args=args_dict)
            if problems:
                raise UserInputError("deepspeed.json" if generated_deepspeed is not None else "--deepspeed",
                                     "; ".join(str(p) for p in problems))
        _check_precision_runs_here(args_dict["deepspeed"], args_dict)

    def before_model(self, recipe, resume_path, output_dir, resharded):
        import deepspeed

        deepspeed.init_distributed()  # before the model: ZeRO-3's zero.Init partitions it at construction
        if recipe.cluster.accelerator == "cpu":
            release_at_exit()
        if resharded:
            return universal_checkpoint(resume_path, output_dir)
        return resume_path


TRAINER_HOOKS = DeepSpeedHooks()
