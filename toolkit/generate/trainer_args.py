"""HF TrainingArguments of a plan, agreeing with the DeepSpeed JSON (or, with fsdp, accelerate.yaml) on every number
both name."""

from __future__ import annotations

from toolkit.generate.deepspeed import warmup_num_steps
from toolkit.spec.backends import backend_of
from toolkit.spec.plan import Plan
from toolkit.spec.recipe import Recipe, data_workers

HF_SCHEDULERS = {"cosine": "cosine_with_min_lr", "linear": "linear", "constant": "constant_with_warmup"}
# HF's `optim` for each plan optimizer: used as is for adamw8bit (DeepSpeed has none), and states the optimizer the
# DeepSpeed JSON configures otherwise, so the file means the same when read without DeepSpeed
HF_OPTIMIZERS = {"adamw": "adamw_torch", "sgd": "sgd", "adamw8bit": "adamw_bnb_8bit"}


def trainer_arguments(recipe: Recipe, plan: Plan, output_dir: str, deepspeed_json: str | None) -> dict:
    """The TrainingArguments keyword arguments; batch numbers and precision are the plan's."""
    training = recipe.training
    args = {
        "output_dir": output_dir,
        "per_device_train_batch_size": plan.micro_batch,
        "per_device_eval_batch_size": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "max_steps": training.max_steps,
        "learning_rate": training.learning_rate,
        "weight_decay": training.weight_decay,
        "adam_beta1": training.adam_beta1,
        "adam_beta2": training.adam_beta2,
        "adam_epsilon": training.adam_eps,
        "max_grad_norm": training.grad_clip,
        "optim": HF_OPTIMIZERS[plan.optimizer],
        "lr_scheduler_type": HF_SCHEDULERS[training.lr_scheduler],
        # DeepSpeed's count (at least 1): transformers < 5.2x compares it with warmup_steps as given and refuses 0 vs 1
        "warmup_steps": warmup_num_steps(training),
        "bf16": plan.precision == "bf16",
        "fp16": plan.precision == "fp16",
        "activation_checkpointing": plan.recompute == "full",  # transformers 5 name of gradient_checkpointing
        "logging_steps": training.logging_steps,
        "save_strategy": "steps",
        "save_steps": training.save_steps or training.max_steps,
        "eval_strategy": "steps" if training.eval_steps else "no",
        "seed": training.seed,
        "data_seed": training.seed,
        "report_to": [r for r in training.report_to if r != "none"] or "none",
        "run_name": recipe.name,
        "use_cpu": recipe.cluster.accelerator == "cpu",
        "dataloader_num_workers": data_workers(recipe),  # the Kubernetes manifests size /dev/shm for them
        "dataloader_pin_memory": recipe.data.pin_memory,
        "remove_unused_columns": False,
        "save_only_model": False,
    }
    if plan.finetune.peft and plan.recompute == "full":
        # a frozen base: non-reentrant checkpointing passes gradients to the adapters inside checkpointed layers
        # whatever the inputs (the reentrant one needs inputs that require grad, or the adapters get none)
        args["activation_checkpointing_kwargs"] = {"use_reentrant": False}
    if recipe.data.blend:  # its sampler starts at the checkpoint's consumed samples: the Trainer skips nothing
        args["ignore_data_skip"] = True
    if training.lr_scheduler == "cosine":
        args["lr_scheduler_kwargs"] = {"min_lr_rate": training.min_lr_ratio}
    if training.eval_steps:
        args["eval_steps"] = training.eval_steps
    if deepspeed_json is not None:
        args["deepspeed"] = deepspeed_json
    args.update(backend_of(plan).generate.trainer_extras(recipe, plan))  # FSDP2's plugin arguments
    return args
