"""The rules of a DeepSpeed plan (HF Trainer + DeepSpeed ZeRO), beyond the ones every plan obeys (spec/plan.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolkit.errors import UserInputError
from toolkit.spec.quantization import LOW_PRECISION

if TYPE_CHECKING:
    from toolkit.spec.plan import Plan

# What a user who set another backend's option reads (the option's own backends are declared in spec/options.py)
FOREIGN = {
    "cp": "context parallelism runs with --backend megatron or fsdp; with deepspeed use --sp (Ulysses)",
    "distributed_optimizer": "is a Megatron-Core option; with DeepSpeed use --zero 1",
    "transformer_impl": "is a Megatron-Core option; DeepSpeed trains the HF modules",
    "fp8_recipe": "is a recipe of --precision fp8, which DeepSpeed does not train here (Accelerate refuses "
                  "mixed_precision beside a deepspeed_config_file); use --backend fsdp or megatron",
}


# fine-tuning methods this backend cannot train -> why (spec/finetune.py): LoRA and QLoRA both train here
FINETUNE_REFUSED: dict[str, str] = {}

def fill(values: dict) -> None:
    """Defaults a DeepSpeed plan derives when resolved: none beyond ZeRO's (Backend.default_zero); Megatron-Core's
    layer modules mean nothing to the HF modules it trains."""
    values["transformer_impl"] = None


def check_steps(steps: int, warmup: int, key: str) -> None:
    """A run of `steps` optimizer steps after `warmup` warm-up steps: any length (HF's schedulers take both)."""


def check_pipeline(pp: int) -> None:
    """A DeepSpeed plan has one pipeline stage (plans, recipes, the search, `dmt validate --pp`)."""
    if pp > 1:  # DeepSpeed's pipeline engine trains a PipelineModule in its own loop, which the HF Trainer is not
        raise UserInputError("--pp", "the HF Trainer cannot run DeepSpeed's pipeline engine (it needs a PipelineModule "
                                     "and DeepSpeed's own training loop); use --backend megatron for pipeline "
                                     "parallelism")


# Read in DeepSpeed 0.19.8's source and run here (2 gloo ranks, a tiny Mixtral, AutoEP's own `mixtral` preset):
# deepspeed.initialize fails in auto_ep.replace_moe_layers, whose output-recorder retargeting calls transformers
# 5.23's _CanRecordRegistry.get(key, default), which takes no default. Its older deepspeed.moe.layer.MoE needs the
# model rewritten around it, which is a hand-written expert-parallel wrapper.
EP_REFUSAL = ("DeepSpeed 0.19.8's AutoEP does not run with transformers 5.23 (its MoE layer replacement fails on "
              "transformers' output recorders); the experts train ZeRO-sharded as ordinary parameters at --ep 1, or "
              "use --backend megatron for expert parallelism")


def check(p: Plan) -> None:
    check_pipeline(p.pp)
    if p.tp > 1:  # launched for real: HF's DeepSpeed config check counts the TP ranks as data-parallel ones
        raise UserInputError("--tp", "DeepSpeed AutoTP does not train through the HF Trainer here (transformers "
                                     "5.23 checks train_batch_size against every rank as data-parallel); use "
                                     "--backend megatron for tensor parallelism")
    if p.vpp > 1:
        raise UserInputError("--vpp", "DeepSpeed's pipeline has no interleaved schedule; use --backend megatron")
    if p.ep > 1:  # the experts train as ordinary parameters (ZeRO shards them with the rest)
        raise UserInputError("--ep", EP_REFUSAL)
    if p.recompute == "selective":
        raise UserInputError("--recompute", "HF models checkpoint whole layers: use none or full with deepspeed")
    if p.precision in LOW_PRECISION:
        # Accelerate 1.15 refuses mixed_precision beside deepspeed_config_file (DeepSpeedPlugin's ignored
        # ACCELERATE_MIXED_PRECISION), and a DeepSpeed JSON has no fp8 section: the toolkit's DeepSpeed launch cannot
        # ask for Accelerate's FP8
        raise UserInputError("--precision", f"{p.precision} with DeepSpeed needs mixed_precision in accelerate.yaml, "
                                            f"which Accelerate refuses beside a deepspeed_config_file; use --backend "
                                            f"fsdp or megatron")
    if p.offload_params != "none" and p.zero != 3:
        raise UserInputError("--offload-params", "parameter offload needs --zero 3")
    if p.offload_optimizer != "none" and p.zero == 0:
        raise UserInputError("--offload-optimizer", "optimizer offload needs --zero 1, 2 or 3")
    if "nvme" in (p.offload_optimizer, p.offload_params) and not p.nvme_path:
        raise UserInputError("--nvme-path", "offload to nvme needs --nvme-path DIR (a local NVMe mount)")
    if p.optimizer == "adamw8bit" and p.zero > 0:
        raise UserInputError("--optimizer", "8-bit AdamW (bitsandbytes) is not a ZeRO-partitionable optimizer; use --zero 0")
