"""The NaN and loss-spike guard (recipe `training.guard`), judged once per optimizer step on the loss of the whole
global batch and on the global gradient norm that gradient clipping computes anyway (one number per step: a non-finite
gradient anywhere makes it inf or nan), with the same numbers on every rank (so every rank takes the same action
without another collective). The backends act on the verdict: stop (raise GuardStop before the step is
applied; nothing is saved), skip (the optimizer step is dropped: no parameter or optimizer-state update, no
learning-rate step), rollback (the latest verified checkpoint is reloaded in place; the data stream goes on, so
the steps since that checkpoint and the data they saw are dropped)."""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.runtime.incident import EXIT_GUARD_STOP, append_incident

log = logging.getLogger(__name__)
MAX_ROLLBACKS_TO_ONE_CHECKPOINT = 3  # then the fault is in the checkpoint, not in the data: stop


class GuardStop(Exception):
    """The guard ended the run (exit code 4)."""

    exit_code = EXIT_GUARD_STOP


@dataclass(frozen=True)
class Verdict:
    action: str | None  # None: a healthy step; else the recipe's on_nan action
    reason: str = ""
    loss: float | None = None
    median: float | None = None


@dataclass
class LossGuard:
    """The spike rule's window: (step, loss) of the last `window` applied steps, carried in every checkpoint's
    manifest (`guard_window`) so that a resumed run judges like the uninterrupted one."""

    on_nan: str = "stop"
    spike_factor: float = 0.0
    window: int = 50
    history: list[tuple[int, float]] = field(default_factory=list)
    rollbacks: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_recipe(cls, guard, history=()) -> "LossGuard":
        return cls(guard.on_nan, guard.spike_factor, guard.window, [(int(s), float(v)) for s, v in history])

    def judge(self, step: int, loss: float, grad_norm: float | None = None) -> Verdict:
        """The verdict on a step's loss and, once known, its global gradient norm (read_grad_norm)."""
        if not math.isfinite(loss):
            return Verdict(self.on_nan, f"the loss of step {step} is {loss}", None)
        if grad_norm is not None and not math.isfinite(grad_norm):
            return Verdict(self.on_nan, f"a gradient of step {step} is not finite (grad norm {grad_norm})", loss)
        if self.spike_factor and len(self.history) >= self.window:
            median = statistics.median(value for _, value in self.history[-self.window:])
            if loss > self.spike_factor * median:
                return Verdict(self.on_nan, f"the loss of step {step}, {loss:.4g}, is above {self.spike_factor:g} x "
                                            f"the median of the last {self.window} steps ({median:.4g})", loss, median)
        return Verdict(None, loss=loss)

    def accept(self, step: int, loss: float) -> None:
        """A step that was applied: its loss joins the window."""
        self.history = (self.history + [(step, loss)])[-self.window:]

    def state(self) -> list[tuple[int, float]]:
        return list(self.history)

    def rolled_back_to(self, checkpoint: Path, history) -> None:
        """After reloading `checkpoint`: its window, and one more rollback to it counted (GuardStop past the cap)."""
        self.rollbacks[checkpoint.name] = self.rollbacks.get(checkpoint.name, 0) + 1
        if self.rollbacks[checkpoint.name] > MAX_ROLLBACKS_TO_ONE_CHECKPOINT:
            raise GuardStop(f"rolled back to {checkpoint.name} {MAX_ROLLBACKS_TO_ONE_CHECKPOINT} times already")
        self.history = [(int(s), float(v)) for s, v in history]


def read_grad_norm(norm) -> float:
    """A step's global gradient norm as clipping returned it (a tensor, a DTensor or a float) on the host: the guard's
    one look at the gradients of a step, one device-to-host read. torch's clip_grad_norm_ (error_if_nonfinite off),
    Accelerate's, DeepSpeed's and Megatron-Core's all report inf or nan when any gradient element is not finite."""
    from torch.distributed.tensor import DTensor

    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def record_verdict(output_dir: Path, rank: int, step: int, verdict: Verdict, data_sha: str | None, **extra) -> None:
    """Rank 0 records the verdict in incident.json (and the log); every rank raises GuardStop for `stop`."""
    if rank == 0:
        append_incident(output_dir, {"event": "guard", "step": step, "action": verdict.action, "reason": verdict.reason,
                                     "loss": verdict.loss, "median": verdict.median, "data_sha": data_sha, **extra})
    if verdict.action == "stop":
        raise GuardStop(f"step {step}: {verdict.reason} (data {data_sha}); nothing was saved")


def step_record(step: int, verdict: Verdict) -> dict:
    """What metrics.jsonl says of a guarded step (a record's `guard` lists those it covers)."""
    return {"step": step, "action": verdict.action, "reason": verdict.reason}
