"""Fault injection for the fault-tolerance tests (test-only): DMT_FAULT names faults that the training loops of both
backends act out at a given step and phase, on the first launch of a job only (a restart runs clean).

    DMT_FAULT="nan@step=5"                          the loss of step 5 becomes NaN (every rank)
    DMT_FAULT="spike=50@step=6"                     the loss of step 6 is multiplied by 50
    DMT_FAULT="stop@rank=1,step=4,phase=manifest"   rank 1 SIGSTOPs itself there (a frozen process)
    DMT_FAULT="hang@rank=1,step=3,phase=train"      rank 1's main thread sleeps there (alive, stuck)
    DMT_FAULT="kill@rank=0,step=4,phase=manifest"   rank 0 SIGKILLs itself there
    DMT_FAULT="slow=30@rank=1,step=3,phase=train"   rank 1 sleeps 30 s there, then goes on (a slow rank: a window
                                                    for a test to act on it from outside, however fast the steps);
                                                    a scheduler's save-and-exit request ends the sleep early
    DMT_FAULT="busy=400@rank=1,step=3,phase=train"  rank 1 computes 400 extra 256x256 matrix products there (a
                                                    straggler by compute: the same work however fast the host)
    DMT_FAULT="slow=60@step=4,phase=persist"        the background write of checkpoint-4 (training.async_save)
                                                    waits 60 s in its writer process before writing a byte
Several faults are separated by ';'. Phases: train (the step's forward, backward and optimizer), save (a checkpoint
is about to be written), persist (its background write: in the writer process of each rank, Megatron-Core's
asynchronous save; in each writing thread of each rank, FSDP2's, before its first byte), manifest (its files are written; the manifest and `latest` are next), save-wait (a save or the
end of training waits for the background write in flight), log.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from toolkit.runtime.incident import is_restart

log = logging.getLogger(__name__)
FAULT_ENV = "DMT_FAULT"
WAKE_POLL_S = 0.1  # how often a slow fault looks for its wake-up file


@dataclass(frozen=True)
class Fault:
    kind: str  # nan | spike | stop | hang | kill | slow | busy
    factor: float
    step: int
    rank: int | None
    phase: str | None


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        what, _, where = part.partition("@")
        kind, _, factor = what.partition("=")
        fields = dict(item.split("=", 1) for item in where.split(",") if item)
        faults.append(Fault(kind, float(factor) if factor else math.nan, int(fields["step"]),
                            int(fields["rank"]) if "rank" in fields else None, fields.get("phase")))
    return faults


def _active() -> list[Fault]:
    text = os.environ.get(FAULT_ENV, "")
    return parse_faults(text) if text and not is_restart() else []


def loss_factor(step: int) -> float | None:
    """What the loss of `step` is multiplied by (NaN or a spike's factor), or None: no fault."""
    for fault in _active():
        if fault.step == step and fault.kind in ("nan", "spike"):
            return math.nan if fault.kind == "nan" else fault.factor
    return None


def at_phase(step: int, phase: str, rank: int, wake: Path | None = None) -> None:
    """Act out a process fault planned for this rank, step and phase; a slow one ends early once `wake` exists."""
    for fault in _active():
        if fault.step != step or fault.kind not in ("stop", "hang", "kill", "slow", "busy") \
                or fault.rank not in (None, rank) \
                or fault.phase not in (None, phase):
            continue
        log.warning("fault injection: %s on rank %d at step %d, phase %s", fault.kind, rank, step, phase)
        if fault.kind == "busy":
            _compute(int(fault.factor))
            continue
        time.sleep(0.5)  # the heartbeat of this phase goes out first, as for a process that froze while in it
        if fault.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "slow":
            _hold(fault.factor, wake)
        else:
            while True:
                time.sleep(3600)


def _compute(products: int) -> None:
    """`products` 256x256 float32 matrix products on this thread: extra compute, as a slow rank's step has."""
    import torch

    matrix = torch.rand(256, 256, generator=torch.Generator().manual_seed(0))
    for _ in range(products):
        matrix = torch.mm(matrix, matrix).clamp_(-1, 1)


def _hold(seconds: float, wake: Path | None) -> None:
    """Sleep `seconds`, or until `wake` exists: the window a test holds a step open for ends when what it waited
    for has arrived (a save-and-exit request is acted on at the end of the step), not a fixed time later."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 and not (wake is not None and wake.exists()):
        time.sleep(min(WAKE_POLL_S, left))
