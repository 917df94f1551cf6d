"""Train with HF Trainer and the generated DeepSpeed config (under deepspeed, accelerate launch or torchrun), or with
FSDP2 through Accelerate's plugin (under accelerate launch or torchrun)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from toolkit.backends.hf_callbacks import callbacks_for
from toolkit.backends.hf_guard import HeldSchedule, TrainerGuard
from toolkit.backends.loop import BatchFingerprints, StepGuard, check_world
from toolkit.backends.resume import guard_window, resume_checkpoint, run_identity
from toolkit.errors import UserInputError
from toolkit.readers import read_json
from toolkit.runtime.guard import LossGuard
from toolkit.runtime.metrics import MetricsWriter, Throughput, configure_wandb
from toolkit.runtime.supervision import TrainingWatchdog
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import Plan
from toolkit.spec.recipe import Recipe, recipe_hf_config

log = logging.getLogger(__name__)


def adapt_for_cpu(ds_config: dict) -> dict:
    """On CPU ranks DeepSpeed's fused CPU Adam would be compiled first; torch's AdamW does the same arithmetic."""
    config = json.loads(json.dumps(ds_config))
    params = config.get("optimizer", {}).get("params")
    if params is not None and config["optimizer"]["type"].lower() in ("adam", "adamw"):
        params["torch_adam"] = True
    return config


def _deepspeed_config(recipe: Recipe, plan: Plan, path: str | None, generated: dict | None) -> dict:
    """The DeepSpeed config this run trains with: the generated file's (as plan.json's directory holds it), a file
    given with --deepspeed, or the generator's output for the recipe's plan."""
    from toolkit.generate.deepspeed import deepspeed_config

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


def installed_field_names(args_dict: dict) -> dict:
    """trainer_args.json uses transformers 5's current names; older 5.x releases (5.17 is on some GPU images) know
    activation checkpointing only by its former name, gradient_checkpointing."""
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    for name in ("activation_checkpointing", "activation_checkpointing_kwargs"):
        if name in args_dict and name not in fields:
            args_dict = dict(args_dict)
            args_dict[name.replace("activation", "gradient")] = args_dict.pop(name)
    return args_dict


def _check_precision_runs_here(config: dict, trainer_args: dict) -> None:
    """DeepSpeed refuses an unsupported precision only after building the model; say so before, in one line."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if (config.get("fp16") or {}).get("enabled") in (True, "auto") and trainer_args.get("fp16"):
        _refuse_fp16_without_gpu()
    for section, supported in (("fp16", accelerator.is_fp16_supported), ("bf16", accelerator.is_bf16_supported)):
        enabled = (config.get(section) or {}).get("enabled")
        if (enabled is True or (enabled == "auto" and trainer_args.get(section))) and not supported():
            raise UserInputError("plan.precision", f"{section} does not run on DeepSpeed's "
                                                   f"{accelerator.device_name()} accelerator; use bf16 or fp32 here")


def _check_world(plan: Plan) -> int:
    world = check_world(plan)
    # `accelerate launch` with an accelerate.yaml of the other backend would mix the two (the Trainer takes its
    # plugin from the launcher's environment)
    for variable, backend in (("ACCELERATE_USE_FSDP", "fsdp"), ("ACCELERATE_USE_DEEPSPEED", "deepspeed")):
        if os.environ.get(variable, "false").lower() == "true" and plan.backend != backend:
            raise UserInputError("plan.backend", f"accelerate launch was given a {backend} accelerate.yaml but the "
                                                 f"plan trains with {plan.backend}; launch with the plan's own "
                                                 f"accelerate.yaml (dmt generate) or pass --backend {backend}")
    return world


def _check_fsdp_runs_here(plan: Plan) -> None:
    """What Accelerate would refuse only after the model is built, said first in one line: fp16 on CPU ranks (its grad
    scaler)."""
    if plan.precision == "fp16":
        _refuse_fp16_without_gpu()


def _refuse_fp16_without_gpu() -> None:
    """fp16 needs Accelerate's grad scaler on a GPU, whatever DeepSpeed's CPU accelerator says of the host (one with
    AVX-512 FP16 reports fp16 supported, and the HF path then fails inside Accelerate)."""
    import torch

    if not torch.cuda.is_available():
        raise UserInputError("plan.precision", "fp16 mixed precision needs a GPU (Accelerate's grad scaler); use bf16 "
                                               "or fp32 on CPU ranks")


def train(recipe: Recipe, model_spec: ModelSpec, plan: Plan, output_dir: Path, deepspeed_json: str | None,
          resume: str | None, generated_deepspeed: dict | None = None, generated_trainer_args: dict | None = None,
          throughput: Throughput | None = None, watch=None) -> dict:
    """Run training; returns a summary (steps, final loss) on every rank. With the generated files' contents
    (`dmt generate`'s deepspeed.json and trainer_args.json) those are what trains; without, the same generators
    make them from the recipe's plan. `throughput` turns step times into tokens/s and MFU (train.py makes it);
    `watch` is this rank's toolkit.runtime.supervision.TrainingWatchdog."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        Trainer,
        TrainingArguments,
        set_seed,
    )

    from toolkit.backends.data import build_tokenizer, load_texts, training_datasets
    from toolkit.checkpoint.manifest import read_manifest
    from toolkit.generate.trainer_args import trainer_arguments

    world = _check_world(plan)
    fsdp = plan.backend == "fsdp"
    watch = watch or TrainingWatchdog(output_dir, 0)  # inactive: only the phases' fault injection
    identity = run_identity(recipe, plan)
    resume_path = resume_checkpoint(output_dir, resume, identity)
    done = (read_manifest(resume_path) or {}).get("step", 0) if resume_path is not None else 0
    if done >= recipe.training.max_steps:  # a restart after the last save (a rank that failed on its way out):
        # nothing is left to train, and HF's Trainer would take one more step before checking
        log.info("%s is at step %d of %d: nothing left to train", resume_path.name, done, recipe.training.max_steps)
        return {"global_step": done, "train_loss": None}
    # another world size: DeepSpeed loads a universal checkpoint (made below, once ranks exist); FSDP2's DCP
    # checkpoints reshard on load by themselves
    resharded = resume_path is not None and (read_manifest(resume_path) or {}).get("world_size") != world
    output_dir.mkdir(parents=True, exist_ok=True)
    if generated_trainer_args is not None:
        args_dict = {**generated_trainer_args, "output_dir": str(output_dir)}
    else:
        args_dict = trainer_arguments(recipe, plan, str(output_dir), None)
    if fsdp:
        if deepspeed_json:
            raise UserInputError("--deepspeed", "is a DeepSpeed option; the fsdp backend shards with FSDP2")
        _check_fsdp_runs_here(plan)
        if isinstance(args_dict.get("parallelism_config"), dict):  # HSDP / TP: Accelerate's ParallelismConfig
            from accelerate import ParallelismConfig

            args_dict["parallelism_config"] = ParallelismConfig(**args_dict["parallelism_config"])
    else:
        _deepspeed_arguments(args_dict, recipe, plan, world, deepspeed_json, generated_deepspeed, resharded)
    configure_wandb(recipe.training.report_to, output_dir)
    args = TrainingArguments(**installed_field_names(args_dict))
    if not fsdp:
        import deepspeed

        deepspeed.init_distributed()  # before the model: ZeRO-3's zero.Init partitions it at construction
        if recipe.cluster.accelerator == "cpu":
            from toolkit.runtime.ds_shm import release_at_exit

            release_at_exit()
        if resharded:
            from toolkit.checkpoint.universal import universal_checkpoint

            resume_path = universal_checkpoint(resume_path, output_dir)
    set_seed(recipe.training.seed)

    tokenizer_dir = output_dir / "tokenizer"
    with args.main_process_first(desc="tokenizer"):
        if tokenizer_dir.is_dir():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        else:
            tokenizer = build_tokenizer(recipe, load_texts(recipe))
            if args.process_index == 0:
                tokenizer.save_pretrained(tokenizer_dir)
        train_set, eval_set, collator = training_datasets(recipe, tokenizer, plan.seq_len)

    if plan.finetune.peft:  # LoRA / QLoRA adapters on a frozen base (toolkit.backends.peft_model)
        from toolkit.backends.peft_model import finetune_model

        model = finetune_model(recipe, plan, output_dir, args)
    elif recipe.model.pretrained:
        model = AutoModelForCausalLM.from_pretrained(recipe.locate(recipe.model.pretrained), dtype=torch.float32)
    else:
        config = AutoConfig.for_model(**recipe_hf_config(recipe))
        if config.vocab_size < len(tokenizer):
            raise UserInputError("model.config.vocab_size", f"{config.vocab_size} < tokenizer size {len(tokenizer)}")
        model = AutoModelForCausalLM.from_config(config, attn_implementation=plan.attention)

    if recipe.data.format != "text":  # packed chat / prompt-completion rows: each example attends to itself only
        from toolkit.backends.sft_data import keep_examples_apart

        keep_examples_apart(model)
    fingerprints = BatchFingerprints()
    metrics = MetricsWriter(output_dir, throughput or Throughput(plan.global_batch * plan.seq_len))
    guard = TrainerGuard(StepGuard(LossGuard.from_recipe(recipe.training.guard, guard_window(resume_path)),
                                   output_dir, args.process_index), fingerprints)

    class ToolkitTrainer(Trainer):
        """HF's Trainer, plus: which samples each step trains on, how long it waits for them, and what each logged
        step cost, put into the logs before any logger (metrics.jsonl, wandb, TensorBoard) sees them; the guard sees
        every micro-batch's loss before backward."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            fingerprints.add(inputs["input_ids"])
            watch.phase(self.state.global_step + 1, "forward")
            self._guarded = True  # compute_loss also serves evaluation, which the guard does not judge
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._guarded = False

        def get_batch_samples(self, *args, **kwargs):  # the Trainer's one wait for data: next() on its loader
            import time

            start = time.perf_counter()
            try:
                return super().get_batch_samples(*args, **kwargs)
            finally:
                metrics.add_data_wait(time.perf_counter() - start)

        def log(self, logs, start_time=None):
            if "loss" in logs:  # a training step's log (every rank gets here: gathering memory is a collective)
                from toolkit.runtime.metrics import gpu_memory_of_ranks, logged_figures

                metrics.pending = {**metrics.measure(self.state.global_step), **gpu_memory_of_ranks()}
                logs.update(logged_figures(metrics.pending))  # loggers take numbers; metrics.jsonl takes them all
            super().log(logs, start_time)

        def _get_grad_norm(self, model, grad_norm=None):
            # the one norm per step the Trainer gets from clipping (or computes without clipping): what the guard
            # reads. A private method of the Trainer (transformers 5.23): the guard refuses a step whose norm it did
            # not see (TrainerGuard.before_optimizer_step), so a rename cannot turn the check off unnoticed
            return guard.on_grad_norm(self, super()._get_grad_norm(model, grad_norm))

        def create_scheduler(self, num_training_steps, optimizer=None):
            schedule = super().create_scheduler(num_training_steps, optimizer)
            if not self.is_deepspeed_enabled and not isinstance(schedule, HeldSchedule):  # DeepSpeed holds its own
                self.lr_scheduler = HeldSchedule(schedule, guard.holds_schedule)
            return self.lr_scheduler

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if fsdp:  # before preparation calls fully_shard with it
                from toolkit.backends.fsdp.train import mixed_precision_policy

                self.accelerator.state.fsdp_plugin.mixed_precision_policy = mixed_precision_policy(plan.precision)

        def compute_loss(self, model, inputs, *args, **kwargs):
            result = super().compute_loss(model, inputs, *args, **kwargs)
            if not getattr(self, "_guarded", False):
                return result
            watch.phase(self.state.global_step + 1, "backward")  # and, under DeepSpeed, the optimizer step
            items = kwargs.get("num_items_in_batch")
            if isinstance(result, tuple):  # (loss, outputs)
                return (guard.on_loss(self, result[0], items), *result[1:])
            return guard.on_loss(self, result, items)

    callbacks = callbacks_for(output_dir, plan, metrics, world, identity, fingerprints, watch, guard)
    toolkit_callback = callbacks[0]  # the guard acts through it on the Trainer
    if plan.finetune.peft:
        from toolkit.backends.peft_model import adapter_callback

        callbacks.insert(0, adapter_callback(plan))  # FSDP2's adapter is written before the manifest lists the files
    if fsdp:
        from toolkit.backends.fsdp.train import sharding_callback

        callbacks.append(sharding_callback(output_dir, plan))
    with _accelerator_building(plan):
        trainer = ToolkitTrainer(model=model, args=args, train_dataset=train_set, eval_dataset=eval_set,
                                 data_collator=collator, processing_class=tokenizer, callbacks=callbacks)
    toolkit_callback.trainer = trainer
    result = trainer.train(resume_from_checkpoint=str(resume_path) if resume_path else None)
    return {"global_step": trainer.state.global_step, "train_loss": result.training_loss}


def _deepspeed_arguments(args_dict: dict, recipe: Recipe, plan: Plan, world: int, deepspeed_json: str | None,
                         generated_deepspeed: dict | None, resharded: bool) -> None:
    """The DeepSpeed config into the trainer arguments, checked against them before DeepSpeed or HF find out
    mid-launch."""
    args_dict["deepspeed"] = _deepspeed_config(recipe, plan, deepspeed_json, generated_deepspeed)
    if resharded:
        args_dict["deepspeed"].setdefault("checkpoint", {})["load_universal"] = True
    if deepspeed_json or generated_deepspeed is not None:
        from toolkit.validate.deepspeed import validate_deepspeed_config

        problems = validate_deepspeed_config(args_dict["deepspeed"], world, trainer_args=args_dict)
        if problems:
            raise UserInputError("deepspeed.json" if generated_deepspeed is not None else "--deepspeed",
                                 "; ".join(str(p) for p in problems))
    _check_precision_runs_here(args_dict["deepspeed"], args_dict)


def _accelerator_building(plan: Plan):
    """Where the Trainer builds its Accelerator: on CPU ranks an fsdp plan needs Accelerate's FSDP path opened."""
    import contextlib

    import torch

    if plan.backend != "fsdp" or torch.cuda.is_available():
        return contextlib.nullcontext()
    from toolkit.compat.accelerate_seams import fsdp_on_cpu_ranks

    return fsdp_on_cpu_ranks()


def train_generated(run, recipe: Recipe, output_dir: Path, resume: str | None, deepspeed_json: str | None,
                    updates: dict, throughput: Throughput | None, watch) -> dict:
    """train.py's entry for the backends that train through the HF Trainer (toolkit/backends/<name>/train.py): the
    generated files' contents of `run` (toolkit.validate.generated.GeneratedRun), the trainer arguments with the
    command line's step overrides."""
    trainer_args = run.trainer_args and {**run.trainer_args, **updates}
    return train(recipe, run.model, run.plan, output_dir, deepspeed_json, resume, run.deepspeed, trainer_args,
                 throughput, watch)
