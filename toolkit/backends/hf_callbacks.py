"""The toolkit's hooks in HF Trainer's loop, for every HF Trainer backend (DeepSpeed, FSDP2 through Accelerate):
which samples each step trained on (data_sha), metrics.jsonl, the watchdog's phases, the guard, a scheduler's
save-and-exit request (toolkit.backends.loop), and a manifest with the `latest` pointer after
every complete save (after a background write, once every rank's is done: toolkit.backends.hf_saves)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from transformers import TrainerCallback

from toolkit.backends.loop import save_and_exit_requested, write_checkpoint_record, write_step_record
from toolkit.checkpoint.manifest import data_position, point_latest, write_manifest
from toolkit.runtime import inprocess
from toolkit.runtime.profile import CHECKPOINT, OPTIMIZER

if TYPE_CHECKING:
    from toolkit.backends.context import HFLaunch


class ToolkitCallback(TrainerCallback):
    """metrics.jsonl on every log; a manifest and the `latest` pointer after every complete save; the watchdog's
    phases and the guard's verdicts around every step; a scheduler's save-and-exit request. With the launch's
    `saves` (a toolkit.backends.hf_saves.TrainerSaves) a save completes once its background write has."""

    def __init__(self, launch: HFLaunch):
        self.launch = launch
        self.trainer = None  # set once the Trainer exists: the guard acts on it
        self.save_started: float | None = None  # when training paused for the checkpoint the Trainer is about to save

    def on_train_begin(self, args, state, control, **kwargs):
        self.launch.metrics.mark(state.global_step)  # on every rank: each measures, rank 0 writes
        self.launch.context.watch.start()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.launch.saves is not None:  # a background write finished on every rank: its manifest and `latest`
            self.launch.saves.poll()  # now, so a save completes a whole step after it was made at the earliest
        self.launch.context.watch.phase(state.global_step + 1, "train")
        self.launch.guard.begin_step()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.launch.saves is not None:  # the save in flight has copied the state it writes
            self.launch.saves.before_optimizer_step()
        self.launch.guard.before_optimizer_step(self.trainer, kwargs["model"])
        self.launch.profiler.enter(OPTIMIZER)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.launch.profiler.leave(OPTIMIZER)

    def on_step_end(self, args, state, control, **kwargs):
        self.launch.guard.end_step(self.trainer)
        inprocess.record_resumed(self.launch.context.output_dir, state.global_step)  # after an in-process restart
        if save_and_exit_requested(self.launch.context.output_dir):
            control.should_save = True
            control.should_training_stop = True
        self.launch.context.watch.phase(state.global_step, "save" if control.should_save else "log")
        if control.should_save:  # the Trainer logs (on_log) and evaluates, then saves
            self.save_started = time.perf_counter()
            self.launch.profiler.enter(CHECKPOINT)

    def on_log(self, args, state, control, logs=None, **kwargs):
        metrics, guard = self.launch.metrics, self.launch.guard
        if logs and "loss" in logs:
            data_sha = self.launch.fingerprints.digest()  # a collective: every rank logs the same steps
            if state.is_world_process_zero:  # the step's figures: measured in ToolkitTrainer.log, before wandb
                # a step the guard judged logs the loss it measured (not HF's NaN filter's stand-in)
                write_step_record(metrics, guard.guard, state.global_step, logs["loss"], logs.get("grad_norm"),
                                  logs.get("learning_rate"), metrics.pending, data_sha, epoch=logs.get("epoch"))
        if self.save_started is not None:  # the save comes next: its pause starts after the log
            self.save_started = time.perf_counter()

    def on_save(self, args, state, control, model=None, **kwargs):
        import torch.distributed as dist

        launch, context = self.launch, self.launch.context
        output_dir, plan, hooks, watch = context.output_dir, context.plan, launch.hooks, context.watch
        ckpt = output_dir / f"checkpoint-{state.global_step}"
        if dist.is_initialized():
            dist.barrier()  # every rank's files are on disk before they are hashed
        hooks.on_save(model, ckpt, state.is_world_process_zero)
        step, started, self.save_started = state.global_step, self.save_started, None

        def complete(files=None):  # every rank, once its files are written; `files`: hashed already
            watch.phase(step, "manifest")
            if dist.is_initialized():
                dist.barrier()  # every rank arrived: none stopped before its files were complete
            manifest = None
            if state.is_world_process_zero:
                layout = {k: getattr(plan, k) for k in (*hooks.layout_keys, "micro_batch", "grad_accum",
                                                        "global_batch")}
                manifest = write_manifest(ckpt, step=step, world_size=launch.world, layout=layout,
                                          fmt=hooks.checkpoint_format,
                                          extra={"run": launch.identity, "guard_window": launch.guard.guard.window(),
                                                 **data_position(step, launch.identity)},
                                          files=files)
                point_latest(output_dir, ckpt)
            if dist.is_initialized():
                dist.barrier()
            return manifest

        if launch.saves is not None:
            launch.saves.saved(step, ckpt, started or time.perf_counter(), complete)
            launch.profiler.leave(CHECKPOINT)
            return
        manifest = complete()
        launch.profiler.leave(CHECKPOINT)
        if state.is_world_process_zero and started is not None:  # synchronous: complete when resumed
            paused = time.perf_counter() - started
            write_checkpoint_record(launch.metrics, manifest, ckpt, paused, paused, asynchronous=False)

    def on_train_end(self, args, state, control, **kwargs):
        if self.launch.saves is not None:
            self.launch.saves.close(state.global_step)  # the save in flight (the last one, a save-and-exit's) completed
