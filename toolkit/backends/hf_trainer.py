"""Train with HF Trainer and the generated DeepSpeed config (under deepspeed, accelerate launch or torchrun), or with
FSDP2 through Accelerate's plugin (under accelerate launch or torchrun)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from toolkit.backends import long_context
from toolkit.spec.backends import BACKENDS, backend_of
from toolkit.backends.hf_callbacks import callbacks_for
from toolkit.backends.hf_guard import HeldSchedule, TrainerGuard
from toolkit.backends.loop import BatchFingerprints, StepGuard, check_world
from toolkit.backends.resume import guard_window, resume_checkpoint, run_identity
from toolkit.checkpoint.manifest import consumed_samples
from toolkit.errors import UserInputError
from toolkit.planner.save_interval import recipe_saves_async
from toolkit.runtime.guard import LossGuard
from toolkit.runtime.metrics import MetricsWriter, Throughput, configure_wandb
from toolkit.runtime.supervision import TrainingWatchdog
from toolkit.spec.model import ModelSpec
from toolkit.spec.options import VARIABLE_LENGTH_ATTENTION
from toolkit.spec.plan import Plan
from toolkit.spec.recipe import Recipe, recipe_hf_config

log = logging.getLogger(__name__)




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



def _check_world(plan: Plan) -> int:
    world = check_world(plan)
    # `accelerate launch` with an accelerate.yaml of the other backend would mix the two (the Trainer takes its
    # plugin from the launcher's environment)
    for backend in (b for b in BACKENDS.values() if b.hf_modules):
        variable = backend.train.HF_PATH.accelerate_variable
        if os.environ.get(variable, "false").lower() == "true" and backend is not backend_of(plan):
            raise UserInputError("plan.backend", f"accelerate launch was given a {backend.name} accelerate.yaml but "
                                                 f"the plan trains with {plan.backend}; launch with the plan's own "
                                                 f"accelerate.yaml (dmt generate) or pass --backend {backend.name}")
    return world




def _tokenised(recipe: Recipe, plan: Plan, args, tokenizer_dir: Path):
    """(tokenizer, train, eval, collator) of train_files or a hub dataset: rank 0 builds and saves the tokenizer
    first, then every rank tokenises (the datasets cache fills once)."""
    from toolkit.backends.data import build_tokenizer, load_texts, training_datasets

    with args.main_process_first(desc="tokenizer"):
        if tokenizer_dir.is_dir():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        else:
            tokenizer = build_tokenizer(recipe, load_texts(recipe))
            if args.process_index == 0:
                tokenizer.save_pretrained(tokenizer_dir)
        train_set, eval_set, collator = training_datasets(recipe, tokenizer, plan.seq_len)
    return tokenizer, train_set, eval_set, collator


def _documents_apart(recipe: Recipe) -> bool:
    """Whether a blend's attention stays inside each document: transformers finds the documents of a packed row from
    its position ids (masking_utils.find_packed_sequence_indices: a block-causal mask for sdpa and eager, variable
    lengths for flash attention), so reset_attention_mask takes reset_position_ids on this path."""
    data = recipe.data
    if data.blend and data.reset_attention_mask and not data.reset_position_ids:
        log.warning("data.reset_attention_mask without data.reset_position_ids: the HF Trainer's models tell "
                    "documents apart by their position ids, so attention stays causal over the whole sequence")
    return bool(data.blend) and data.reset_attention_mask and data.reset_position_ids


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

    from toolkit.checkpoint.manifest import read_manifest
    from toolkit.generate.trainer_args import trainer_arguments

    world = _check_world(plan)
    path = backend_of(plan).train.HF_PATH  # what DeepSpeed or FSDP2 adds to the HF Trainer's path
    asynchronous = recipe_saves_async(recipe, plan)
    if recipe.training.async_save and not asynchronous:
        log.warning("training.async_save: %s checkpoints are written synchronously under the HF Trainer (none of "
                    "its checkpoint engines runs there; README, 'Asynchronous checkpoints'); each save's pause is in "
                    "metrics.jsonl", backend_of(plan).label)
    watch = watch or TrainingWatchdog(output_dir, 0)  # inactive: only the phases' fault injection
    identity = run_identity(recipe, plan)
    resume_path = resume_checkpoint(output_dir, resume, identity)
    consumed = consumed_samples(resume_path)  # a blend reads on from there (its sampler, not the Trainer's skip)
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
    path.arguments(args_dict, recipe, plan, world, deepspeed_json, generated_deepspeed, resharded)
    long_context.build_parallelism_config(args_dict)
    configure_wandb(recipe.training.report_to, output_dir)
    args = TrainingArguments(**installed_field_names(args_dict))
    resume_path = path.before_model(recipe, resume_path, output_dir, resharded)
    set_seed(recipe.training.seed)

    tokenizer_dir = output_dir / "tokenizer"
    documents_apart = _documents_apart(recipe)
    # flash attention's variable-length kernel sees documents only in a batch of one row: the micro-batch flattened
    flat = documents_apart and plan.attention in VARIABLE_LENGTH_ATTENTION
    if recipe.data.blend:  # prepared tokens through Megatron-Core's datasets (a collective: rank 0 builds the cache)
        from transformers import AutoTokenizer

        from toolkit.data.blend import build_datasets, hf_batch, hf_flat_batch
        from toolkit.spec.recipe import recipe_vocab_size

        tokenizer = AutoTokenizer.from_pretrained(recipe.path(recipe.data.tokenizer.path))
        train_set, eval_set = build_datasets(recipe, plan.seq_len, plan.global_batch, output_dir,
                                             recipe_vocab_size(recipe))
        collator = hf_flat_batch if flat else hf_batch
    else:
        tokenizer, train_set, eval_set, collator = _tokenised(recipe, plan, args, tokenizer_dir)
    if plan.sp > 1:
        collator = long_context.with_position_ids(collator)

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

    if recipe.data.format != "text" or documents_apart:  # packed rows: each attends to itself only
        from toolkit.backends.sft_data import keep_examples_apart

        keep_examples_apart(model)
    long_context.prepare(model, plan, output_dir, args.process_index)
    fingerprints = BatchFingerprints()
    metrics = MetricsWriter(output_dir, throughput or Throughput(plan.global_batch * plan.seq_len))
    saves = None
    if asynchronous:  # FSDP2's DCP directories written in the background (toolkit.backends.hf_saves)
        from toolkit.backends.background_saves import save_wait_s
        from toolkit.backends.hf_saves import TrainerSaves

        saves = TrainerSaves(metrics if args.process_index == 0 else None, watch, save_wait_s(recipe),
                             args.process_index)
        log.info("checkpoints are written in the background (training.async_save)")
    guard = TrainerGuard(StepGuard(LossGuard.from_recipe(recipe.training.guard, guard_window(resume_path)),
                                   output_dir, args.process_index), fingerprints, saves)

    class ToolkitTrainer(Trainer):
        """HF's Trainer, plus: which samples each step trains on, how long it waits for them, and what each logged
        step cost, put into the logs before any logger (metrics.jsonl, wandb, TensorBoard) sees them; the guard sees
        every micro-batch's loss before backward."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            ids = inputs["input_ids"]  # per sample: a flattened micro-batch is micro_batch x seq_len tokens in one row
            fingerprints.add(ids.reshape(-1, plan.seq_len) if flat else ids)
            watch.phase(self.state.global_step + 1, "forward")
            self._guarded = True  # compute_loss also serves evaluation, which the guard does not judge
            try:
                with long_context.activation_offload(plan):
                    return super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._guarded = False

        def _get_train_sampler(self, *args, **kwargs):
            if not recipe.data.blend:
                return super()._get_train_sampler(*args, **kwargs)
            from toolkit.data.blend import ConsumedSampler

            return ConsumedSampler(len(train_set), consumed)  # the blend's global order from the checkpoint's count

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

        def _save_optimizer_and_scheduler(self, output_dir):
            # the one part of the Trainer's save that writes the model and optimizer state (FSDP2: Accelerate's DCP
            # save); in the background when asked (toolkit.compat.transformers_seams names this override)
            if saves is None:
                return super()._save_optimizer_and_scheduler(output_dir)
            with saves.writing(self.state.global_step):
                return super()._save_optimizer_and_scheduler(output_dir)

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            path.on_accelerator(self.accelerator, plan)  # before preparation (FSDP2: fully_shard's precision)

        def compute_loss(self, model, inputs, *args, **kwargs):
            result = super().compute_loss(model, inputs, *args, **kwargs)
            if not getattr(self, "_guarded", False):
                return result
            if plan.sp > 1:  # the Ulysses loss's gradient arrives sp times over (long_context.ulysses_gradient)
                result = (long_context.ulysses_gradient(result[0], plan.sp), *result[1:]) \
                    if isinstance(result, tuple) else long_context.ulysses_gradient(result, plan.sp)
            watch.phase(self.state.global_step + 1, "backward")  # and, under DeepSpeed, the optimizer step
            items = kwargs.get("num_items_in_batch")
            if isinstance(result, tuple):  # (loss, outputs)
                return (guard.on_loss(self, result[0], items), *result[1:])
            return guard.on_loss(self, result, items)

    callbacks = callbacks_for(output_dir, plan, metrics, world, identity, fingerprints, watch, guard, saves)
    toolkit_callback = callbacks[0]  # the guard acts through it on the Trainer
    if plan.finetune.peft:
        from toolkit.backends.peft_model import adapter_callback

        callbacks.insert(0, adapter_callback(plan))  # FSDP2's adapter is written before the manifest lists the files
    callbacks += path.callbacks(output_dir, plan)
    with path.accelerator_building(plan):
        trainer = ToolkitTrainer(model=model, args=args, train_dataset=train_set, eval_dataset=eval_set,
                                 data_collator=collator, processing_class=tokenizer, callbacks=callbacks)
    toolkit_callback.trainer = trainer
    result = trainer.train(resume_from_checkpoint=str(resume_path) if resume_path else None)
    return {"global_step": trainer.state.global_step, "train_loss": result.training_loss}




def train_generated(run, recipe: Recipe, output_dir: Path, resume: str | None, deepspeed_json: str | None,
                    updates: dict, throughput: Throughput | None, watch) -> dict:
    """train.py's entry for the backends that train through the HF Trainer (toolkit/backends/<name>/train.py): the
    generated files' contents of `run` (toolkit.validate.generated.GeneratedRun), the trainer arguments with the
    command line's step overrides."""
    trainer_args = run.trainer_args and {**run.trainer_args, **updates}
    return train(recipe, run.model, run.plan, output_dir, deepspeed_json, resume, run.deepspeed, trainer_args,
                 throughput, watch)
