"""The DeepSpeed JSON of a plan: batch sizes, precision, ZeRO stage and buckets, offload, optimizer, scheduler."""

from __future__ import annotations

from toolkit.estimate.memory import (
    DS_ALLGATHER_BUCKET_ELEMENTS,
    DS_OVERLAP_COMM,
    DS_REDUCE_BUCKET_ELEMENTS,
    DS_STAGE3_MAX_LIVE_PARAMETERS,
    DS_STAGE3_PREFETCH_ELEMENTS,
)
from toolkit.spec.plan import Plan
from toolkit.spec.recipe import TrainingSection

SCHEDULERS = {"cosine": "WarmupCosineLR", "linear": "WarmupDecayLR", "constant": "WarmupLR"}


def _offload(device: str, nvme_path: str | None) -> dict:
    section = {"device": device, "pin_memory": True}
    if device == "nvme":
        section["nvme_path"] = nvme_path
    return section


def zero_section(plan: Plan) -> dict:
    zero = {"stage": plan.zero}
    if plan.zero == 0:
        return zero
    zero.update(overlap_comm=DS_OVERLAP_COMM, contiguous_gradients=True, reduce_bucket_size=DS_REDUCE_BUCKET_ELEMENTS)
    if plan.zero in (1, 2):
        zero.update(allgather_partitions=True, allgather_bucket_size=DS_ALLGATHER_BUCKET_ELEMENTS, reduce_scatter=True)
    if plan.zero == 3:
        zero.update(stage3_prefetch_bucket_size=DS_STAGE3_PREFETCH_ELEMENTS,
                    stage3_max_live_parameters=DS_STAGE3_MAX_LIVE_PARAMETERS,
                    stage3_gather_16bit_weights_on_model_save=True)
        if plan.offload_params != "none":
            zero["offload_param"] = _offload(plan.offload_params, plan.nvme_path)
    if plan.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(plan.offload_optimizer, plan.nvme_path)
    return zero


def _optimizer(plan: Plan, training: TrainingSection) -> dict:
    if plan.optimizer == "sgd":
        return {"type": "SGD", "params": {"lr": training.learning_rate, "momentum": training.adam_beta1,
                                          "weight_decay": training.weight_decay}}
    return {"type": "AdamW", "params": {"lr": training.learning_rate, "betas": [training.adam_beta1, training.adam_beta2],
                                        "eps": training.adam_eps, "weight_decay": training.weight_decay}}


def _scheduler(training: TrainingSection) -> dict:
    kind = SCHEDULERS[training.lr_scheduler]
    if kind == "WarmupCosineLR":
        params = {"total_num_steps": training.max_steps, "warmup_num_steps": training.warmup_steps,
                  "warmup_min_ratio": 0.0, "cos_min_ratio": training.min_lr_ratio}
    elif kind == "WarmupDecayLR":
        params = {"total_num_steps": training.max_steps, "warmup_min_lr": 0.0, "warmup_max_lr": training.learning_rate,
                  "warmup_num_steps": training.warmup_steps, "warmup_type": "linear"}
    else:
        params = {"warmup_min_lr": 0.0, "warmup_max_lr": training.learning_rate,
                  "warmup_num_steps": training.warmup_steps, "warmup_type": "linear"}
    return {"type": kind, "params": params}


def deepspeed_config(plan: Plan, training: TrainingSection) -> dict:
    """The DeepSpeed config dict; every batch number is the plan's."""
    config = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": training.grad_clip,
        "bf16": {"enabled": plan.precision == "bf16"},
        "fp16": {"enabled": plan.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "zero_optimization": zero_section(plan),
        "optimizer": _optimizer(plan, training),
        "scheduler": _scheduler(training),
        "steps_per_print": max(1, training.logging_steps),
        "wall_clock_breakdown": False,
    }
    if plan.tp > 1:  # DeepSpeed AutoTP training
        config["tensor_parallel"] = {"autotp_size": plan.tp}
    return config
