"""The toolkit's hooks in HF Trainer's loop, for every HF Trainer backend (DeepSpeed, FSDP2 through Accelerate):
which samples each step trained on (data_sha), metrics.jsonl, the watchdog's phases, the guard, a scheduler's
save-and-exit request (the file SAVE_AND_EXIT in the output directory), and a manifest with the `latest` pointer after
every complete save."""

from __future__ import annotations

from pathlib import Path

from toolkit.runtime.metrics import MetricsWriter
from toolkit.spec.plan import Plan

SAVE_AND_EXIT = "SAVE_AND_EXIT"


class BatchFingerprints:
    """Fingerprints the token ids of every micro-batch the model trains on, so each logged step records which
    samples its update saw (`data_sha`): a resumed run must see exactly what the uninterrupted one saw. Fed from
    `training_step` (not the collator, which the data loader runs ahead of training); only the last `micro_batches`
    count."""

    def __init__(self, micro_batches: int):
        self.micro_batches = micro_batches
        self.recent: list[bytes] = []

    def add(self, input_ids) -> None:
        import hashlib

        digest = hashlib.sha256(input_ids.detach().cpu().numpy().tobytes()).digest()
        self.recent = (self.recent + [digest])[-self.micro_batches:]

    def digest(self, clear: bool = True) -> str:
        """Called on every rank at the same step: the micro-batches of all data-parallel ranks, in a canonical
        order, so the fingerprint names the global batch whatever the world size (a resume on fewer ranks sees the
        same micro-batches, dealt out differently)."""
        import hashlib

        import torch.distributed as dist

        digests = self.recent
        if clear:
            self.recent = []
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, digests)
            digests = [digest for part in gathered for digest in part]
        return hashlib.sha256(b"".join(sorted(digests))).hexdigest()[:16]


def callbacks_for(output_dir: Path, plan: Plan, metrics: MetricsWriter, world: int, identity: dict,
               fingerprints: BatchFingerprints, watch, guard):
    """The toolkit's hooks in HF Trainer's loop (any HF Trainer backend: DeepSpeed, FSDP2 through Accelerate)."""
    from transformers import TrainerCallback

    from toolkit.checkpoint.manifest import (
        DEEPSPEED_FORMAT,
        FSDP_FORMAT,
        point_latest,
        write_manifest,
    )

    fsdp = plan.backend == "fsdp"
    layout_keys = (("dp", "dp_shard", "dp_replicate", "tp", "reshard_after_forward") if fsdp
                   else ("dp", "tp", "pp", "zero"))

    class ToolkitCallback(TrainerCallback):
        """metrics.jsonl on every log; a manifest and the `latest` pointer after every complete save; the watchdog's
        phases and the guard's verdicts around every step."""

        trainer = None  # set once the Trainer exists: the guard acts on it

        def on_train_begin(self, args, state, control, **kwargs):
            metrics.mark(state.global_step)  # on every rank: each measures, rank 0 writes
            watch.start()

        def on_step_begin(self, args, state, control, **kwargs):
            watch.phase(state.global_step + 1, "train")
            guard.begin_step(self.trainer)

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            guard.before_optimizer_step(self.trainer, kwargs["model"])

        def on_step_end(self, args, state, control, **kwargs):
            guard.end_step(self.trainer)
            # a scheduler's "save and exit" request (the SLURM script's USR1 handler touches this file); every rank
            # must agree on the step, so the flag is reduced across ranks
            import torch
            import torch.distributed as dist

            flag = torch.tensor([1.0 if (output_dir / SAVE_AND_EXIT).exists() else 0.0], device=args.device)
            if dist.is_initialized():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                control.should_save = True
                control.should_training_stop = True
            watch.phase(state.global_step, "save" if control.should_save else "log")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                data_sha = fingerprints.digest()  # a collective: every rank logs the same steps
                if state.is_world_process_zero:  # the step's figures: measured in ToolkitTrainer.log, before wandb
                    # a step the guard judged logs the loss it measured (not HF's NaN filter's stand-in)
                    extra = {"loss": logs["loss"], **guard.metrics_of(state.global_step)}
                    metrics.write(state.global_step, extra.pop("loss"), logs.get("grad_norm"),
                                  logs.get("learning_rate"), metrics.pending, epoch=logs.get("epoch"),
                                  data_sha=data_sha, **extra)

        def on_save(self, args, state, control, model=None, **kwargs):
            import torch.distributed as dist

            watch.phase(state.global_step, "manifest")
            ckpt = output_dir / f"checkpoint-{state.global_step}"
            if dist.is_initialized():
                dist.barrier()  # every rank's files are on disk before they are hashed
            if state.is_world_process_zero:
                if fsdp:  # sharded DCP weights carry no config: `dmt convert fsdp-to-hf` finds it beside them
                    model.config.save_pretrained(ckpt)
                layout = {k: getattr(plan, k) for k in (*layout_keys, "micro_batch", "grad_accum", "global_batch")}
                write_manifest(ckpt, step=state.global_step, world_size=world, layout=layout,
                               fmt=FSDP_FORMAT if fsdp else DEEPSPEED_FORMAT,
                               extra={"run": identity, "guard_window": guard.guard.state()})
                point_latest(output_dir, ckpt)
            if dist.is_initialized():
                dist.barrier()

    return [ToolkitCallback()]
