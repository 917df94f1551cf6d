"""The NaN and loss-spike guard inside HF Trainer's loop (toolkit.runtime.guard decides, toolkit.backends.loop reports
and picks the rollback target; this acts through the Trainer and the engines).

The verdict on the loss is reached at the last micro-batch of a step, after its forward and before its backward (the
loss of the whole global batch: one all-reduce per step), so `stop` raises before anything is applied. The verdict on
the gradients reads the one number gradient clipping computes, the global gradient norm the Trainer gets from
Accelerate (torch's clip_grad_norm_ under FSDP2, DeepSpeed's own norm under DeepSpeed), right before the optimizer
step: no gradient is looked at one by one.

A skipped step is dropped the way each engine supports:
- without DeepSpeed (FSDP2 through Accelerate), the Trainer's own optimizer step runs on no gradient: the gradients
  are set to None just before it, and torch's optimizers leave a parameter without one untouched (no update, no
  weight decay, no moment or step count); the learning-rate schedule is held for that step (HeldSchedule, handed to
  the Trainer through its create_scheduler);
- under DeepSpeed the optimizer step runs inside that backward (Accelerate's DeepSpeedEngineWrapper), and DeepSpeed
  drops a step whose gradients are not finite by itself (its overflow check, on for ZeRO 1-3 with bf16 and fp16): no
  parameter, optimizer state or learning-rate step, `was_step_applied()` false. A NaN loss gets there on its own; a
  spike has finite gradients, and DeepSpeed has no API to drop such a step: the one seam,
  toolkit.compat.deepspeed_seams.drop_zero_step.
A rollback's step is applied (or dropped) as the engine decides; the reload that follows replaces it: HF Trainer's own
resume functions load the latest verified checkpoint in place, HF's step counter and its data loader go on, so the
steps since that checkpoint, and their data, are dropped. DeepSpeed's engine gets its counters back from the checkpoint
like everything else (they count the steps applied), so its tag inside a later checkpoint-N is the one `latest` names.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from toolkit.backends.loop import BatchFingerprints, StepGuard
from toolkit.compat.deepspeed_seams import drop_zero_step
from toolkit.compat.transformers_seams import load_model_state, load_optimizer_and_scheduler, loss_as_logged
from toolkit.runtime import faults
from toolkit.runtime.guard import Verdict, read_grad_norm

log = logging.getLogger(__name__)


class TrainerGuard:
    """One per rank: the shared StepGuard, and the step in flight as the Trainer runs it."""

    def __init__(self, guard: StepGuard, fingerprints: BatchFingerprints, saves=None):
        self.guard, self.fingerprints = guard, fingerprints
        self.saves = saves  # toolkit.backends.hf_saves.TrainerSaves when checkpoints are written in the background
        self.micro: list = []
        self.loss: float | None = None
        self.norm_read = False

    # ---- inside the step ---------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        self.micro, self.loss, self.norm_read = [], None, False
        self.guard.begin_step()

    def on_loss(self, trainer, loss, num_items_in_batch=None):
        """Every micro-batch's loss, before its backward; returns the loss to back-propagate."""
        import torch
        import torch.distributed as dist

        step = trainer.state.global_step + 1
        factor = faults.loss_factor(step)
        if factor is not None:
            loss = loss * factor
        self.micro.append(loss_as_logged(trainer, loss.detach().float().reshape(()), num_items_in_batch))
        if len(self.micro) < trainer.current_gradient_accumulation_steps:
            return loss
        values = torch.stack(self.micro).cpu().double().tolist()
        finite = [value for value in values if math.isfinite(value)]
        stats = torch.tensor([sum(finite), len(values) - len(finite), 1.0], dtype=torch.double)
        if dist.is_initialized():
            device = stats.to(trainer.args.device)
            dist.all_reduce(device)
            stats = device.cpu()
        self.loss = float(stats[0] / stats[2]) if stats[1] == 0 else float("nan")  # what HF logs for the step
        verdict = self.guard.judge(step, self.loss)
        if verdict.action is None:
            return loss
        verdict = self._act(step, verdict)  # `stop` raises here, before the backward
        if verdict.action == "skip" and _engine(trainer) is not None and math.isfinite(self.loss):
            return drop_zero_step(loss)  # a skipped spike: DeepSpeed drops it as it drops an overflow
        return loss

    def on_grad_norm(self, trainer, norm):
        """The step's global gradient norm, as the Trainer got it from clipping (once per optimizer step, before it
        under FSDP2, after DeepSpeed's inside the backward): read once, judged unless the loss was; returned as the
        float the Trainer logs."""
        engine = _engine(trainer)
        value = read_grad_norm(norm) if norm is not None else None
        self.norm_read = True
        if self.guard.verdict is None:
            dropped = engine is not None and not engine.was_step_applied()  # DeepSpeed's own overflow drop
            verdict = self.guard.judge(trainer.state.global_step + 1, self.loss, math.inf if dropped else value)
            if verdict.action is not None:
                self._act(trainer.state.global_step + 1, verdict)
        return value

    def before_optimizer_step(self, trainer, model) -> None:
        """Without DeepSpeed: a dropped step's gradients go, so the optimizer step that follows moves nothing."""
        if not self.norm_read:  # the Trainer changed how it hands out the norm: the guard would judge nothing
            raise RuntimeError("the guard did not see this step's gradient norm (ToolkitTrainer._get_grad_norm was "
                               "not called before the optimizer step)")
        if _engine(trainer) is None and self.guard.drops_step():
            model.zero_grad(set_to_none=True)

    def holds_schedule(self) -> bool:
        return self.guard.drops_step()

    def end_step(self, trainer) -> None:
        """After the step: a skip DeepSpeed applied refused; a healthy step's loss kept; a rollback done."""
        step, engine = trainer.state.global_step, _engine(trainer)
        if self.guard.drops_step() and engine is not None and engine.was_step_applied():
            raise RuntimeError(f"step {step}: the guard dropped this step but DeepSpeed applied it (is "
                               f"bf16.check_grad_overflow off in deepspeed.json?)")
        self.guard.end_step(step, self.loss)
        target = self.guard.rolling_back()
        if target is not None:
            self.guard.rolled_back(step)
            reload_checkpoint(trainer, target)

    def _act(self, step: int, verdict: Verdict) -> Verdict:
        if verdict.action == "rollback" and self.saves is not None:  # every rank: the verdict is on reduced figures
            self.saves.wait(step)  # the save in flight, once complete, is the checkpoint to go back to
        return self.guard.act(step, verdict, self.fingerprints.digest(clear=False))


class HeldSchedule:
    """The Trainer's learning-rate schedule, not stepped for a step the guard drops. The Trainer steps it unless
    Accelerate's optimizer says the step was skipped, which only Accelerate's fp16 grad scaler can say; the schedule
    is the Trainer's to replace (create_scheduler), so the guard holds it here. Everything else is the schedule's."""

    def __init__(self, schedule, held):
        self.schedule, self._held = schedule, held

    def step(self, *args, **kwargs):
        if not self._held():
            self.schedule.step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.schedule, name)


def _engine(trainer):
    """The DeepSpeed engine, when DeepSpeed trains."""
    return trainer.model_wrapped if getattr(trainer, "is_deepspeed_enabled", False) else None


def reload_checkpoint(trainer, checkpoint: Path) -> None:
    """Model, optimizer and scheduler states of `checkpoint`, loaded into the running trainer as HF Trainer's own
    resume loads them (DeepSpeed's engine, FSDP's sharded state, or the plain model); the RNG and the data loader go
    on, so the data stream is the one the run would have seen anyway."""
    from peft import PeftMixedModel, PeftModel
    from transformers.integrations.deepspeed import deepspeed_load_checkpoint

    if trainer.is_deepspeed_enabled:  # a PEFT model's module states are its adapters only: HF's resume loads them
        deepspeed_load_checkpoint(trainer.model_wrapped, str(checkpoint),  # non-strictly too
                                  load_module_strict=not isinstance(trainer.model, (PeftModel, PeftMixedModel)))
    else:
        load_model_state(trainer, str(checkpoint))
    load_optimizer_and_scheduler(trainer, str(checkpoint))
