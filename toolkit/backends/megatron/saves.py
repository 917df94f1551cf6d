"""The checkpoints of a Megatron-Core run as its loop takes them: synchronously, or (training.async_save, as
megatron.yaml's schedule.async_save says) in the background through dist_checkpointing's asynchronous save on its
persistent writer process (toolkit.compat.megatron_async), with the toolkit's rules around it:

- a checkpoint becomes visible only once complete: every rank polls at each step (one collective), and only when every
  rank's write has finished do Megatron-Core's finalization (the metadata) and then the toolkit's (manifest, `latest`,
  rank 0) run, from the training processes, never from the writer;
- at most one save in flight: the next save, the end of training (after a scheduler's save-and-exit too) wait for it,
  at most `wait_s` (every rank gives up together; the log names the checkpoint, and the run fails: `latest` stays on
  the checkpoint before); the watchdog's exit waits for this rank's write as long, without collectives, then ends
  the writer (the checkpoint has no manifest: `dmt ckpt verify` rejects it, a restart resumes from `latest`);
- every complete checkpoint gets its metrics.jsonl record (toolkit.backends.loop.write_checkpoint_record): the time
  training was paused for it (the save's own part, the polls that finished it, any wait for it) and the time until
  it was complete.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
POLL_S = 0.05  # between the polls of a wait


class CheckpointNotWritten(RuntimeError):
    """A background write did not finish within the wait."""


@dataclass
class _InFlight:
    step: int
    checkpoint: Path
    started: float  # when training paused for it
    blocked_s: float = 0.0  # pauses for it so far
    poll_started: float = 0.0


class CheckpointSaves:
    """One per rank. `metrics` is rank 0's MetricsWriter (None elsewhere); `watch` its TrainingWatchdog."""

    def __init__(self, asynchronous: bool, metrics, watch, wait_s: float):
        self.asynchronous, self.metrics, self.watch, self.wait_s = asynchronous, metrics, watch, wait_s
        self.calls = None  # the AsyncCallsQueue
        self.written = None  # the writer's count of finished writes
        self.scheduled = 0
        self.in_flight: _InFlight | None = None

    def start(self) -> None:
        """Every rank, once the process group exists: the writer process starts now, not inside the first save."""
        if not self.asynchronous:
            return
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        from toolkit.compat.megatron_async import start_writer

        self.calls = AsyncCallsQueue(persistent=True)
        self.written = start_writer(self.calls, self.wait_s)
        self.watch.before_exit(self.abandon)
        log.info("checkpoints are written in the background (training.async_save)")

    def save(self, step: int, checkpoint: Path, write: Callable, complete: Callable) -> None:
        """`write(asynchronous)` saves every rank's part (an AsyncRequest when asynchronous); `complete()` runs on
        every rank once all of it is on disk and returns rank 0's manifest."""
        self.wait(step)
        self.watch.phase(step, "save")
        started = time.perf_counter()
        if not self.asynchronous:
            write(False)
            self._complete(_InFlight(step, checkpoint, started, poll_started=started), complete, asynchronous=False)
            return
        import torch.distributed as dist

        from toolkit.compat.megatron_async import prepared

        request = write(True)
        save = _InFlight(step, checkpoint, started)
        request.add_finalize_fn(functools.partial(self._complete, save, complete))
        self.calls.schedule_async_request(prepared(request, functools.partial(_persist, step, dist.get_rank())))
        self.scheduled += 1
        self.in_flight = save
        save.blocked_s = time.perf_counter() - started

    def poll(self) -> None:
        """Every rank at the same point of every step: a finished background write is completed now."""
        save = self.in_flight
        if save is None:
            return
        save.poll_started = time.perf_counter()
        self.calls.maybe_finalize_async_calls(blocking=False)
        if self.in_flight is save:
            save.blocked_s += time.perf_counter() - save.poll_started

    def wait(self, step: int) -> None:
        """Every rank: the save in flight completed, at most `wait_s` from now."""
        save = self.in_flight
        if save is None:
            return
        from toolkit.backends.loop import reduced_flag
        from toolkit.compat.megatron_async import stop_writer

        self.watch.phase(step, "save-wait")
        deadline = time.perf_counter() + self.wait_s
        while True:
            self.poll()
            if self.in_flight is None:
                return
            if reduced_flag(time.perf_counter() > deadline, "MAX"):  # every rank gives up at the same poll
                log.error("%s: its background write did not finish within %.0f s; abandoned (latest stays on the "
                          "checkpoint before)", save.checkpoint.name, self.wait_s)
                stop_writer(self.calls)
                self.in_flight = None
                raise CheckpointNotWritten(f"{save.checkpoint.name} was not written within {self.wait_s:.0f} s")
            time.sleep(POLL_S)
            save.blocked_s += POLL_S

    def close(self, step: int) -> None:
        """Every rank at the end of training: the save in flight completed, the writer ended."""
        if self.calls is None:
            return
        self.wait(step)
        self.calls.close()
        self.calls = None

    def abandon(self) -> None:
        """This rank is ended by the watchdog: its write in progress may finish (at most `wait_s`), then the writer
        ends; the checkpoint gets no manifest (the other ranks did not agree it was complete)."""
        from toolkit.compat.megatron_async import stop_writer

        if self.calls is None:
            return
        save, deadline = self.in_flight, time.monotonic() + self.wait_s
        while save is not None and self.written.value < self.scheduled and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if save is not None:
            finished = self.written.value >= self.scheduled
            (log.warning if finished else log.error)(
                "%s: %s; it stays without a manifest", save.checkpoint.name,
                "this rank's background write finished" if finished else
                f"this rank's background write did not finish within {self.wait_s:.0f} s and is abandoned")
        stop_writer(self.calls)

    def _complete(self, save: _InFlight, complete: Callable, asynchronous: bool = True) -> None:
        from toolkit.backends.loop import write_checkpoint_record

        manifest = complete()
        now = time.perf_counter()
        self.in_flight = None
        if self.metrics is not None:
            write_checkpoint_record(self.metrics, manifest, save.checkpoint, save.blocked_s + now - save.poll_started,
                                    now - save.started, asynchronous)


def _persist(step: int, rank: int, write, *args, **kwargs) -> None:
    """A background write, in this rank's writer process: the test faults of the `persist` phase, then the write."""
    from toolkit.runtime import faults

    faults.at_phase(step, "persist", rank)
    write(*args, **kwargs)
