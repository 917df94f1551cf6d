"""The DeepSpeed JSON of a plan: batch sizes, precision, ZeRO stage and buckets, ZeRO++, offload, optimizer, scheduler."""

from __future__ import annotations

from toolkit.errors import UserInputError
from toolkit.spec.engine_settings import (  # the bucket sizes the memory model counts
    DS_ALLGATHER_BUCKET_ELEMENTS,
    DS_OVERLAP_COMM,
    DS_REDUCE_BUCKET_ELEMENTS,
    DS_STAGE3_MAX_LIVE_PARAMETERS,
    DS_STAGE3_PREFETCH_ELEMENTS,
)
from toolkit.spec.plan import Plan
from toolkit.spec.recipe_training import DeepSpeedSection, TrainingSection

SCHEDULERS = {"cosine": "WarmupCosineLR", "linear": "WarmupDecayLR", "constant": "WarmupLR"}
# DeepSpeed's optimizer for each plan optimizer; None: HF Trainer builds it (bitsandbytes) and hands it to DeepSpeed
DS_OPTIMIZERS = {"adamw": "AdamW", "sgd": "SGD", "adamw8bit": None}
# The values HF Trainer fills in when they say "auto" (transformers.integrations.deepspeed.trainer_config_process)
HF_AUTO_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "bf16.enabled", "fp16.enabled", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
    "optimizer.params.weight_decay", "scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps",
    "scheduler.params.warmup_max_lr", "scheduler.params.warmup_min_lr",
)


def warmup_num_steps(training: TrainingSection) -> int:
    """DeepSpeed >= 0.19.6 rejects warm-up steps <= 0, and HF fills max(1, warmup_steps); no warm-up means 1 step."""
    return max(1, training.warmup_steps)


def _offload(device: str, nvme_path: str | None) -> dict:
    section = {"device": device, "pin_memory": True}
    if device == "nvme":
        section["nvme_path"] = nvme_path
    return section


def _zero_plus_plus(plan: Plan) -> dict:
    """hpZ: a secondary copy of the parameter partition inside each node, so forward/backward all-gathers stay on
    NVLink; qwZ/qgZ: weights and gradients cross the network quantized. It only pays off for ZeRO-3 across nodes."""
    hpz = plan.gpus_per_node // plan.tp
    if plan.zero != 3 or plan.gpus <= plan.gpus_per_node or hpz < 2:
        raise UserInputError("deepspeed.zero_plus_plus", f"ZeRO++ applies to ZeRO-3 across nodes; this plan is ZeRO-"
                                                         f"{plan.zero} on {plan.gpus} GPU(s) with {plan.gpus_per_node} "
                                                         f"per node: set plan.zero: 3 on several nodes, or remove it")
    return {"zero_hpz_partition_size": hpz, "zero_quantized_weights": True, "zero_quantized_gradients": True}


def zero_section(plan: Plan, options: DeepSpeedSection | None = None) -> dict:
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
    if options is not None and options.zero_plus_plus:
        zero.update(_zero_plus_plus(plan))
    return zero


def _optimizer(plan: Plan, training: TrainingSection) -> dict | None:
    kind = DS_OPTIMIZERS[plan.optimizer]
    if kind is None:
        return None
    if kind == "SGD":
        return {"type": kind, "params": {"lr": training.learning_rate, "momentum": training.adam_beta1,
                                         "weight_decay": training.weight_decay}}
    return {"type": kind, "params": {"lr": training.learning_rate, "betas": [training.adam_beta1, training.adam_beta2],
                                     "eps": training.adam_eps, "weight_decay": training.weight_decay}}


def _scheduler(training: TrainingSection) -> dict:
    kind = SCHEDULERS[training.lr_scheduler]
    warmup = warmup_num_steps(training)
    if kind == "WarmupCosineLR":
        params = {"total_num_steps": training.max_steps, "warmup_num_steps": warmup, "warmup_min_ratio": 0.0,
                  "cos_min_ratio": training.min_lr_ratio, "warmup_type": "linear"}
    elif kind == "WarmupDecayLR":
        params = {"total_num_steps": training.max_steps, "warmup_min_lr": 0.0, "warmup_max_lr": training.learning_rate,
                  "warmup_num_steps": warmup, "warmup_type": "linear"}
    else:
        params = {"warmup_min_lr": 0.0, "warmup_max_lr": training.learning_rate, "warmup_num_steps": warmup,
                  "warmup_type": "linear"}
    return {"type": kind, "params": params}


def _set_auto(config: dict) -> dict:
    """Replace every value HF Trainer fills in with "auto" (only where the config has that key)."""
    for dotted in HF_AUTO_KEYS:
        node, *path = dotted.split(".")
        parent, leaf = (config, node) if not path else (config.get(node), path[-1])
        for part in path[:-1]:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if isinstance(parent, dict) and leaf in parent:
            parent[leaf] = "auto"
    return config


def deepspeed_config(plan: Plan, training: TrainingSection, options: DeepSpeedSection | None = None) -> dict:
    """The DeepSpeed config dict; every batch number is the plan's."""
    config = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": training.grad_clip,
        "bf16": {"enabled": plan.precision == "bf16"},
        "fp16": {"enabled": plan.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "zero_optimization": zero_section(plan, options),
    }
    optimizer = _optimizer(plan, training)
    if optimizer is not None:
        config["optimizer"] = optimizer
    else:  # HF Trainer's optimizer is handed to DeepSpeed, which must be told to accept it under ZeRO
        config["zero_allow_untested_optimizer"] = True
    config.update(scheduler=_scheduler(training), steps_per_print=max(1, training.logging_steps),
                  wall_clock_breakdown=False)
    if plan.sp > 1:  # what DeepSpeedConfig divides the world by where no mpu is given (HF's zero.Init of ZeRO-3)
        config["sequence_parallel_size"] = plan.sp
        # HF's config check counts every rank as data-parallel (world x micro x accumulation); Accelerate then sets
        # micro x accumulation x dp, the plan's global batch, just before deepspeed.initialize (accelerator.py)
        config["train_batch_size"] = "auto"
    if options is not None and options.auto_values:
        _set_auto(config)
    return config
