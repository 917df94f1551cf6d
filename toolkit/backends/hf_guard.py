"""The NaN and loss-spike guard inside HF Trainer's loop (toolkit.runtime.guard decides; this acts).

The verdict on the loss is reached at the last micro-batch of a step, after its forward and before its backward (the
loss of the whole global batch: one all-reduce per step). Under DeepSpeed the optimizer step runs inside that
backward (accelerate's DeepSpeedEngineWrapper), so a step is dropped through DeepSpeed's own overflow path: the
guard makes that last loss NaN, DeepSpeed's check of the gradients (on for ZeRO 1-3, bf16, fp16) discards the step,
does not step the learning rate, and counts it in `skipped_steps`; a step DeepSpeed dropped by itself (a non-finite
gradient with a finite loss) is judged after it. Without DeepSpeed (an HF Trainer whose optimizer step is its own,
e.g. FSDP2 through Accelerate) the gradients are checked and, for a dropped step, cleared just before
`optimizer.step()`, so no parameter or optimizer state moves, and Accelerate's optimizer says the step was skipped
(what its fp16 grad scaler says of an overflow), so the Trainer does not step the learning-rate schedule either:
the same as DeepSpeed's drop.
A rollback reloads the latest verified checkpoint with HF Trainer's own resume functions, in place: HF's step
counter and its data loader go on, so the steps since that checkpoint, and their data, are dropped.
"""

from __future__ import annotations

import logging
from pathlib import Path

from toolkit.runtime import faults
from toolkit.runtime.guard import LossGuard, Verdict, report, step_record

log = logging.getLogger(__name__)


class TrainerGuard:
    """One per rank: the guard's window and the verdict of the step in flight."""

    def __init__(self, guard: LossGuard, output_dir: Path, fingerprints):
        self.guard, self.output_dir, self.fingerprints = guard, output_dir, fingerprints
        self.micro: list = []
        self.verdict: Verdict | None = None
        self.loss: float | None = None
        self.skipped_before = 0
        self.target: Path | None = None  # the checkpoint a rollback reloads
        self.records: dict[int, dict] = {}  # step -> what metrics.jsonl says of a guarded step

    # ---- inside the step ---------------------------------------------------------------------------------------

    def begin_step(self, trainer) -> None:
        self.micro, self.verdict, self.loss = [], None, None
        engine = _engine(trainer)
        self.skipped_before = engine.skipped_steps if engine is not None else 0

    def on_loss(self, trainer, loss, num_items_in_batch=None):
        """Every micro-batch's loss, before its backward; returns the loss to back-propagate."""
        import torch
        import torch.distributed as dist

        step = trainer.state.global_step + 1
        factor = faults.loss_factor(step)
        if factor is not None:
            loss = loss * factor
        self.micro.append(_as_logged(trainer, loss.detach().float().reshape(()), num_items_in_batch))
        if len(self.micro) < trainer.current_gradient_accumulation_steps:
            return loss
        values = torch.stack(self.micro).cpu().double()
        finite = torch.isfinite(values)
        stats = torch.stack([values[finite].sum(), (~finite).sum().double(), torch.tensor(1.0, dtype=torch.double)])
        if dist.is_initialized():
            device = stats.to(trainer.args.device)
            dist.all_reduce(device)
            stats = device.cpu()
        self.loss = float(stats[0] / stats[2]) if stats[1] == 0 else float("nan")  # what HF logs for the step
        verdict = self.guard.judge(step, self.loss)
        if verdict.action is None:
            return loss
        self._act(trainer, step, verdict)
        return loss * float("nan") if _engine(trainer) is not None else loss

    def before_optimizer_step(self, trainer, model) -> None:
        """Without DeepSpeed: the gradients are here; a non-finite one is judged, a dropped step's are cleared."""
        import torch
        import torch.distributed as dist

        if _engine(trainer) is not None:
            return
        step = trainer.state.global_step + 1
        if self.verdict is None:
            bad = torch.zeros(1, device=trainer.args.device)
            for param in model.parameters():
                if param.grad is not None and not torch.isfinite(param.grad).all():
                    bad += 1
            if dist.is_initialized():
                dist.all_reduce(bad)
            if bad.item():
                self._act(trainer, step, self.guard.judge(step, self.loss, grads_finite=False))
        if self.verdict is not None:
            model.zero_grad(set_to_none=True)  # torch optimizers leave a parameter without a gradient untouched
            _mark_skipped(trainer, True)  # and the Trainer leaves the learning-rate schedule where it is

    def end_step(self, trainer) -> None:
        """After the step: DeepSpeed's own drop of a step judged; a rollback done; a healthy step's loss kept."""
        step, engine = trainer.state.global_step, _engine(trainer)
        _mark_skipped(trainer, False)
        dropped = engine is not None and engine.skipped_steps > self.skipped_before
        if self.verdict is None and dropped:
            self._act(trainer, step, self.guard.judge(step, self.loss, grads_finite=False))
        elif self.verdict is not None and engine is not None and not dropped:
            raise RuntimeError(f"step {step}: the guard dropped this step but DeepSpeed applied it (is "
                               f"bf16.check_grad_overflow off in deepspeed.json?)")
        if self.verdict is None:
            self.guard.accept(step, self.loss)
        elif self.verdict.action == "rollback":
            self._rollback(trainer, step)

    # ---- acting on a verdict ------------------------------------------------------------------------------------

    def _act(self, trainer, step: int, verdict: Verdict) -> None:
        target, extra = None, {}
        if verdict.action == "rollback":
            target, extra = self._rollback_target(step)
            if target is None:
                verdict = Verdict("stop", verdict.reason + "; no verified checkpoint to roll back to", verdict.loss)
        self.verdict, self.target = verdict, target
        self.records[step] = {"loss": verdict.loss, "guard": step_record(step, verdict)}
        report(self.output_dir, trainer.args.process_index, step, verdict, self.fingerprints.digest(clear=False),
               **extra)

    def _rollback_target(self, step: int) -> tuple[Path | None, dict]:
        from toolkit.checkpoint.manifest import latest_verified, read_manifest

        target = latest_verified(self.output_dir)
        if target is None:
            return None, {}
        return target, {"checkpoint": target.name, "dropped_steps": [read_manifest(target)["step"] + 1, step]}

    def _rollback(self, trainer, step: int) -> None:
        from toolkit.checkpoint.manifest import read_manifest

        manifest = read_manifest(self.target)
        self.guard.rolled_back_to(self.target, manifest.get("guard_window", []))
        reload_checkpoint(trainer, self.target)
        engine = _engine(trainer)
        if engine is not None:  # DeepSpeed counts steps as HF does (its tag global_step<N> follows checkpoint-<N>);
            dropped = step - manifest["step"]  # the dropped ones as DeepSpeed counts the steps it drops itself
            engine.global_steps, engine.skipped_steps = step, engine.skipped_steps + dropped
            engine.global_samples = step * engine.train_batch_size()
        log.warning("guard: rolled back to %s at step %d; steps %d-%d dropped", self.target.name, step,
                    manifest["step"] + 1, step)

    def metrics_of(self, step: int) -> dict:
        """The guard's word on the steps logged now (the loss it measured, not HF's NaN filter's stand-in)."""
        guarded = {s: self.records.pop(s) for s in sorted(self.records) if s <= step}
        if not guarded:
            return {}
        extra = {"guard": [record["guard"] for record in guarded.values()]}
        if step in guarded:
            extra["loss"] = guarded[step]["loss"]
        return extra


def _as_logged(trainer, loss, num_items_in_batch):
    """A micro-batch's share of the step's loss as HF Trainer's training_step returns it (and then sums for its
    log): divided by the accumulation steps unless the loss already is (HF's own test, transformers 5)."""
    scaled = trainer.loss_is_scaled_for_ga
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) \
            or trainer.compute_loss_func is not None
    return loss if scaled else loss / trainer.current_gradient_accumulation_steps


def _engine(trainer):
    """The DeepSpeed engine, when DeepSpeed trains."""
    return trainer.model_wrapped if getattr(trainer, "is_deepspeed_enabled", False) else None


def reload_checkpoint(trainer, checkpoint: Path) -> None:
    """Model, optimizer and scheduler states of `checkpoint`, loaded into the running trainer as HF Trainer's own
    resume loads them (DeepSpeed's engine, FSDP's sharded state, or the plain model); the RNG and the data loader go
    on, so the data stream is the one the run would have seen anyway."""
    from peft import PeftMixedModel, PeftModel
    from transformers.integrations.deepspeed import deepspeed_load_checkpoint

    from toolkit.compat.transformers_seams import load_model_state, load_optimizer_and_scheduler

    if trainer.is_deepspeed_enabled:  # a PEFT model's module states are its adapters only: HF's resume loads them
        deepspeed_load_checkpoint(trainer.model_wrapped, str(checkpoint),  # non-strictly too
                                  load_module_strict=not isinstance(trainer.model, (PeftModel, PeftMixedModel)))
    else:
        load_model_state(trainer, str(checkpoint))
    load_optimizer_and_scheduler(trainer, str(checkpoint))


def _mark_skipped(trainer, skipped: bool) -> None:
    """Accelerate's optimizer reports `step_was_skipped` from the flag its grad scaler sets on an overflow, and the
    Trainer steps the schedule only when it is false; without a scaler nothing else sets it."""
    optimizer = trainer.optimizer
    if hasattr(optimizer, "_is_overflow") and getattr(optimizer, "scaler", None) is None:
        optimizer._is_overflow = skipped
