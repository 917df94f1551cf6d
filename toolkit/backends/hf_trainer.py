"""ToolkitTrainer, the toolkit's HF Trainer, and `train`: the launch of every backend that trains through it."""

from __future__ import annotations

import logging
import time

from transformers import Trainer, set_seed

from toolkit.backends import long_context
from toolkit.backends.background_saves import save_wait_s
from toolkit.backends.context import HFLaunch, TrainContext
from toolkit.backends.hf_callbacks import ToolkitCallback
from toolkit.backends.hf_guard import HeldSchedule, TrainerGuard
from toolkit.backends.hf_inputs import build_model, check_launch, training_arguments, training_data
from toolkit.backends.hf_saves import TrainerSaves
from toolkit.backends.loop import BatchFingerprints, StepGuard
from toolkit.backends.peft_model import adapter_callback
from toolkit.backends.resume import guard_window, resume_checkpoint, run_identity
from toolkit.checkpoint.manifest import consumed_samples, read_manifest
from toolkit.data.blend import ConsumedSampler, ReadSamples
from toolkit.planner.save_interval import recipe_saves_async
from toolkit.runtime.guard import LossGuard
from toolkit.runtime.metrics import MetricsWriter, gpu_memory_of_ranks, logged_figures
from toolkit.runtime.profile import DATA, StepProfiler
from toolkit.spec.backends import backend_of

log = logging.getLogger(__name__)


class ToolkitTrainer(Trainer):
    """HF's Trainer, plus: which samples each step trains on, how long it waits for them, and what each logged
    step cost, put into the logs before any logger (metrics.jsonl, wandb, TensorBoard) sees them; the guard sees
    every micro-batch's loss before backward."""

    def __init__(self, launch: HFLaunch, **kwargs):
        self.launch = launch  # first: Trainer.__init__ builds the Accelerator (create_accelerator_and_postprocess)
        self._guarded = False  # compute_loss also serves evaluation, which the guard does not judge
        super().__init__(**kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        plan = self.launch.context.plan
        ids = inputs["input_ids"]  # per sample: a flattened micro-batch is micro_batch x seq_len tokens in one row
        self.launch.fingerprints.add(ids.reshape(-1, plan.seq_len) if self.launch.flat else ids)
        self.launch.context.watch.phase(self.state.global_step + 1, "forward")
        self._guarded = True
        try:
            with long_context.activation_offload(plan):
                return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._guarded = False

    def _get_train_sampler(self, *args, **kwargs):
        if not self.launch.context.recipe.data.blend:
            return super()._get_train_sampler(*args, **kwargs)

        # the blend's global order from the checkpoint's count
        return ConsumedSampler(len(self.train_dataset), self.launch.consumed)

    def get_batch_samples(self, *args, **kwargs):  # the Trainer's one wait for data: next() on its loader
        profiler = self.launch.profiler
        profiler.begin_step(self.state.global_step + 1)  # a step starts with its data (before on_step_begin)
        start = time.perf_counter()
        try:
            with profiler.span(DATA):
                return super().get_batch_samples(*args, **kwargs)
        finally:
            self.launch.metrics.add_data_wait(time.perf_counter() - start)

    def log(self, logs, start_time=None):
        if "loss" in logs:  # a training step's log (every rank gets here: gathering memory is a collective)

            metrics = self.launch.metrics
            metrics.pending = {**metrics.measure(self.state.global_step), **gpu_memory_of_ranks()}
            logs.update(logged_figures(metrics.pending))  # loggers take numbers; metrics.jsonl takes them all
        super().log(logs, start_time)

    def _get_grad_norm(self, model, grad_norm=None):
        # the one norm per step the Trainer gets from clipping (or computes without clipping): what the guard
        # reads. A private method of the Trainer (transformers 5.23): the guard refuses a step whose norm it did
        # not see (TrainerGuard.before_optimizer_step), so a rename cannot turn the check off unnoticed
        return self.launch.guard.on_grad_norm(self, super()._get_grad_norm(model, grad_norm))

    def create_scheduler(self, num_training_steps, optimizer=None):
        schedule = super().create_scheduler(num_training_steps, optimizer)
        if not self.is_deepspeed_enabled and not isinstance(schedule, HeldSchedule):  # DeepSpeed holds its own
            self.lr_scheduler = HeldSchedule(schedule, self.launch.guard.holds_schedule)
        return self.lr_scheduler

    def _save_optimizer_and_scheduler(self, output_dir):
        # the one part of the Trainer's save that writes the model and optimizer state (FSDP2: Accelerate's DCP
        # save); in the background when asked (toolkit.compat.transformers_seams names this override)
        saves = self.launch.saves
        if saves is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        with saves.writing(self.state.global_step):
            return super()._save_optimizer_and_scheduler(output_dir)

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        # before preparation (FSDP2: fully_shard's precision)
        self.launch.hooks.on_accelerator(self.accelerator, self.launch.context.plan)

    def compute_loss(self, model, inputs, *args, **kwargs):
        if isinstance(self.train_dataset, ReadSamples):  # a blend: its token ids against the vocabulary, each batch
            self.train_dataset.bound.check(inputs["input_ids"])
        result = super().compute_loss(model, inputs, *args, **kwargs)
        if not self._guarded:
            return result
        plan, guard, watch = self.launch.context.plan, self.launch.guard, self.launch.context.watch
        if plan.sp > 1:  # the Ulysses loss's gradient arrives sp times over (long_context.ulysses_gradient)
            result = (long_context.ulysses_gradient(result[0], plan.sp), *result[1:]) \
                if isinstance(result, tuple) else long_context.ulysses_gradient(result, plan.sp)
        watch.phase(self.state.global_step + 1, "backward")  # and, under DeepSpeed, the optimizer step
        items = kwargs.get("num_items_in_batch")
        if isinstance(result, tuple):  # (loss, outputs)
            return (guard.on_loss(self, result[0], items), *result[1:])
        return guard.on_loss(self, result, items)


def train(context: TrainContext) -> dict:
    """train.py's entry for the backends that train through the HF Trainer (toolkit/backends/<name>/train.py):
    the generated files of context.run (`dmt generate`'s deepspeed.json and trainer_args.json, with the command
    line's step overrides) train; without them (a launch without --plan) the same generators make them from the
    recipe's plan. Returns a summary (steps, final loss) on every rank."""
    recipe, plan, output_dir, watch = context.recipe, context.plan, context.output_dir, context.watch
    world = check_launch(plan)
    hooks = backend_of(plan).train.TRAINER_HOOKS  # what DeepSpeed or FSDP2 adds to the HF Trainer
    asynchronous = recipe_saves_async(recipe, plan)
    if recipe.training.async_save and not asynchronous:
        log.warning("training.async_save: %s checkpoints are written synchronously under the HF Trainer (none of "
                    "its checkpoint engines runs there; README, 'Asynchronous checkpoints'); each save's pause is in "
                    "metrics.jsonl", backend_of(plan).label)
    identity = run_identity(recipe, plan)
    resume_path = resume_checkpoint(output_dir, context.resume, identity)
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
    args = training_arguments(context, hooks, world, resharded)
    resume_path = hooks.before_model(recipe, resume_path, output_dir, resharded)
    set_seed(recipe.training.seed)
    data = training_data(recipe, plan, args, output_dir)
    model = build_model(recipe, plan, output_dir, args, data)

    fingerprints = BatchFingerprints()
    metrics = MetricsWriter(output_dir, context.throughput)
    saves = None
    if asynchronous:  # FSDP2's DCP directories written in the background (toolkit.backends.hf_saves)
        saves = TrainerSaves(metrics if args.process_index == 0 else None, watch, save_wait_s(recipe),
                             args.process_index)
        log.info("checkpoints are written in the background (training.async_save)")
    guard = TrainerGuard(StepGuard(LossGuard.from_recipe(recipe.training.guard, guard_window(resume_path)),
                                   output_dir, args.process_index), fingerprints, saves)
    profiler = StepProfiler.from_recipe(recipe, output_dir, args.process_index)
    launch = HFLaunch(context, hooks, world, identity, consumed, data.flat, fingerprints, metrics, guard, saves,
                      profiler)

    toolkit_callback = ToolkitCallback(launch)  # the guard acts through it on the Trainer
    callbacks = [toolkit_callback]
    if plan.finetune.peft:
        callbacks.insert(0, adapter_callback(plan))  # FSDP2's adapter is written before the manifest lists the files
    callbacks += hooks.callbacks(output_dir, plan)
    with hooks.accelerator_building(plan):
        trainer = ToolkitTrainer(launch, model=model, args=args, train_dataset=data.train_set,
                                 eval_dataset=data.eval_set, data_collator=data.collator,
                                 processing_class=data.tokenizer, callbacks=callbacks)
    toolkit_callback.trainer = trainer
    try:
        result = trainer.train(resume_from_checkpoint=str(resume_path) if resume_path else None)
    finally:
        profiler.close()  # a window that reached the last step is written now
    return {"global_step": trainer.state.global_step, "train_loss": result.training_loss}
