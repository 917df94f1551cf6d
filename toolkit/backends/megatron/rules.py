"""The rules of a Megatron-Core plan, beyond the ones every plan obeys (spec/plan.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolkit.errors import UserInputError
from toolkit.spec.quantization import LOW_PRECISION

if TYPE_CHECKING:
    from toolkit.spec.plan import Plan

TE_MODULES = ("Transformer Engine layer modules (--transformer-impl, or a recipe's plan.transformer_impl: "
              "transformer_engine)")
# What a user who set another backend's option reads (the option's own backends are declared in spec/options.py)
FOREIGN = {
    "zero": "is a DeepSpeed option; with Megatron use --distributed-optimizer",
    "offload_optimizer": "offload is modelled for --backend deepspeed only",
    "offload_params": "offload is modelled for --backend deepspeed only",
    "sp": "Ulysses is DeepSpeed's; Megatron-Core splits the sequence with --cp",
    "offload_activations": "Megatron-Core's cpu_offloading refuses recomputation (TransformerConfig); use --recompute "
                           "full alone, or --backend deepspeed/fsdp",
    "attention": "names the HF models' attention kernels; Megatron-Core's attention is Transformer Engine's fused one "
                 "or its own unfused one: choose with --transformer-impl (transformer_engine or local)",
}


# fine-tuning methods this backend cannot train -> why (spec/finetune.py)
EP_REFUSAL = None  # Megatron-Core's own MoE layer, folded over its expert mesh (spec/moe_rules.py _check_expert_mesh)
FINETUNE_REFUSED = {method: f"{method} trains PEFT adapters on the HF modules; Megatron-Core 0.16 has no LoRA of its own "
                            f"(Megatron-Bridge's PEFT is not part of it): use --backend deepspeed or fsdp"
                    for method in ("lora", "qlora")}

def fill(values: dict) -> None:
    """Megatron-Core's layer modules: Transformer Engine's unless the plan says `local`."""
    values["transformer_impl"] = values["transformer_impl"] or "transformer_engine"


def check_steps(steps: int, warmup: int, key: str) -> None:
    """A run of `steps` optimizer steps after `warmup` warm-up steps: Megatron-Core's scheduler asserts warmup <
    decay steps."""
    if steps <= warmup:
        raise UserInputError(key, f"must be above the recipe's training.warmup_steps ({warmup}) for Megatron-Core's "
                                  f"learning-rate scheduler, got {steps}")


def check(p: Plan) -> None:
    if p.transformer_impl == "local" and p.precision in LOW_PRECISION:
        raise UserInputError("--precision", f"{p.precision} needs {TE_MODULES}")
    if p.fp8_param_gather and not p.distributed_optimizer:  # Megatron-LM's validate_args
        raise UserInputError("--fp8-param-gather", "is only supported with the distributed optimizer: add "
                                                   "--distributed-optimizer")
    if p.transformer_impl == "local" and p.cp > 1:
        raise UserInputError("--cp", f"context parallelism needs {TE_MODULES}")
    if p.sequence_parallel and p.tp == 1:
        raise UserInputError("--sequence-parallel", "needs --tp > 1")
    if p.optimizer == "adamw8bit":
        raise UserInputError("--optimizer", "Megatron-Core supports adamw and sgd")
