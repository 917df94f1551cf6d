"""The rules of an FSDP2 plan (Accelerate's FSDP2 + HF Trainer: fully_shard over dp_shard ranks, HSDP replicated
dp_replicate times), beyond the ones every plan obeys (spec/plan.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolkit.errors import UserInputError
from toolkit.spec.options import flag
from toolkit.spec.quantization import check_accelerate

if TYPE_CHECKING:
    from toolkit.spec.plan import Plan

OWN_OPTIONS = ("dp_shard", "dp_replicate", "reshard_after_forward")
_HF_MODULES = "is a Megatron-Core option; FSDP2 trains the HF modules"
_NOT_PART = "is not part of the fsdp backend (Accelerate's FSDP2 + HF Trainer); use --backend megatron"
# What a user who set another backend's option reads (the option's own backends are declared in spec/options.py)
FOREIGN = {
    "zero": "is a DeepSpeed option; FSDP2 shards parameters, gradients and optimizer states over --dp-shard",
    "sp": "Ulysses sequence parallelism runs with --backend deepspeed (Accelerate's sp_backend is deepspeed); with "
          "fsdp use --cp (torch context parallel)",
    "distributed_optimizer": _HF_MODULES,
    "sequence_parallel": _HF_MODULES,
    "transformer_impl": _HF_MODULES,
    "offload_optimizer": "FSDP2's CPUOffloadPolicy moves parameters, gradients and optimizer states together: use "
                         "--offload-params cpu",
}


# fine-tuning methods this backend cannot train -> why (spec/finetune.py)
FINETUNE_REFUSED = {"qlora": "qlora with FSDP2 is not supported: fully_shard turns bitsandbytes' Params4bit into plain "
                             "DTensors and drops their quantisation state; use --backend deepspeed (ZeRO-3 shards the "
                             "4-bit base)"}

def fill(values: dict) -> None:
    """One replica (HSDP: each of dp_replicate) shards over all its data ranks, freeing gathered layers after forward;
    Megatron-Core's layer modules mean nothing to the HF modules it trains."""
    replicas = values["dp_replicate"] = values["dp_replicate"] or 1
    values["dp_shard"] = values["dp_shard"] or max(1, values["dp"] // replicas)
    values["reshard_after_forward"] = values["reshard_after_forward"] in (None, True)
    values["transformer_impl"] = None


def check_steps(steps: int, warmup: int, key: str) -> None:
    """A run of `steps` optimizer steps after `warmup` warm-up steps: any length (HF's schedulers take both)."""


# Read in transformers 5.23 and accelerate 1.15: transformers' expert parallelism (DistributedConfig ep_size) shards
# the experts while from_pretrained loads the model on its device mesh; Accelerate's FSDP2 plugin has no expert axis
# and the HF Trainer this backend trains under loads the model unsharded, so neither applies here.
EP_REFUSAL = ("Accelerate 1.15's FSDP2 has no expert-parallel axis and transformers 5.23's (DistributedConfig "
              "ep_size) applies only to a model from_pretrained loads on its own device mesh, while HF Trainer loads "
              "it unsharded; the experts train FSDP2-sharded at --ep 1, or use --backend megatron")


def check(p: Plan) -> None:
    missing = [name for name in OWN_OPTIONS if getattr(p, name) is None]
    if missing:
        raise UserInputError(flag(missing[0]), "must be set for an fsdp plan")
    if p.pp > 1:
        raise UserInputError("--pp", f"pipeline parallelism {_NOT_PART}")
    if p.ep > 1:  # the experts train FSDP2-sharded as ordinary parameters
        raise UserInputError("--ep", EP_REFUSAL)
    if p.recompute == "selective":
        raise UserInputError("--recompute", "FSDP2 checkpoints whole decoder layers: use none or full with fsdp")
    if p.tp > 1:  # Accelerate applies TP only to a model transformers loaded sharded by a TP plan (DistributedConfig)
        raise UserInputError("--tp", "FSDP2 with tensor parallelism needs the model loaded sharded by a TP plan "
                                     "(transformers' DistributedConfig), which the fsdp backend does not do; use "
                                     "--backend megatron for tensor parallelism")
    check_accelerate(p)
    if p.offload_params == "nvme":
        raise UserInputError("--offload-params", "FSDP2 offloads to cpu memory only; use --offload-params cpu")
    if p.optimizer == "adamw8bit":
        raise UserInputError("--optimizer", "8-bit AdamW over FSDP2's DTensor shards is not modelled; use adamw or sgd")
    if p.dp_replicate * p.dp_shard != p.dp:
        raise UserInputError("--dp-shard", f"dp_replicate x dp_shard = {p.dp_replicate} x {p.dp_shard} must equal the "
                                           f"data-parallel ranks gpus / {'(tp x cp)' if p.cp > 1 else 'tp'} = {p.dp}")
    if p.cp > 1 and p.attention != "sdpa":  # torch's context_parallel dispatches scaled_dot_product_attention only
        raise UserInputError("--attention", f"torch's context parallelism (--cp) runs sdpa only, not {p.attention}")
    if p.dp_shard == 1 and p.dp_replicate > 1:  # accelerate/parallelism_config.py: FSDP needs a dp_shard dimension
        raise UserInputError("--dp-replicate", f"{p.dp_replicate} leaves one rank per shard group: FSDP2 has nothing to "
                                               f"shard over (Accelerate refuses dp_shard_size 1 here); lower it so that "
                                               f"--dp-shard is at least 2")
