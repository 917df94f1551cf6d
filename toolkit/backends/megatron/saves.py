"""The checkpoints of a Megatron-Core run as its loop takes them: synchronously, or (training.async_save, as
megatron.yaml's schedule.async_save says) in the background through dist_checkpointing's asynchronous save on its
persistent writer process (toolkit.compat.megatron_async), with the toolkit's rules around it
(toolkit.backends.background_saves). On CPU ranks the state the writer gets is copied into shared memory by a thread
of the rank while the next step's forward and backward run (they change nothing the save holds); the optimizer's
update waits for what is left of that copy (`handed_over`), and the request goes to the writer then. Megatron-Core's
finalization (the metadata) runs once every rank's write has finished, then rank 0 hashes the files in a thread while
training goes on, and the toolkit's completion (manifest, `latest`) follows at the first poll after that; a save
abandoned after the bounded wait ends the writer.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from toolkit.backends.background_saves import BackgroundSaves, InFlight, in_thread
from toolkit.backends.loop import reduced_flag
from toolkit.compat.megatron_async import (
    copied,
    needs_copy,
    prepared,
    released,
    start_results_queue,
    start_writer,
    stop_writer,
)
from toolkit.runtime import faults

log = logging.getLogger(__name__)


class CheckpointSaves(BackgroundSaves):
    """One per rank. `metrics` is rank 0's MetricsWriter (None elsewhere); `watch` its TrainingWatchdog."""

    def __init__(self, asynchronous: bool, metrics, watch, wait_s: float):
        super().__init__(metrics, watch, wait_s)
        self.asynchronous = asynchronous
        self.calls = None  # the AsyncCallsQueue
        self.written = None  # the writer's count of finished writes
        self.scheduled = 0
        self.hashing: Future | None = None  # rank 0's hashing of the finalized save's files (a finished None elsewhere)
        self.complete: Callable | None = None  # its manifest and `latest`, once hashed
        self.copying: Future | None = None  # a CPU save's copy into shared memory (the request, once copied)

    def start(self) -> None:
        """Every rank, once the process group exists: the writers' results queue and (asynchronous) the writer process
        start now, not inside the first save."""
        start_results_queue()
        if not self.asynchronous:
            return
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.calls = AsyncCallsQueue(persistent=True)
        self.written = start_writer(self.calls, self.wait_s / 2)  # within the start's allowance (STARTUP_FACTOR)
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
            self._complete(InFlight(step, checkpoint, started, poll_started=started), complete, asynchronous=False)
            return
        import torch.distributed as dist

        request = write(True)
        save = InFlight(step, checkpoint, started)
        request.add_finalize_fn(functools.partial(self._written, save, complete))
        request = prepared(request, functools.partial(_persist, step, dist.get_rank()))
        self.in_flight = save
        if needs_copy(request):
            self.copying = in_thread("dmt-checkpoint-copy", copied, request)
        else:
            self._schedule(request)
        save.blocked_s = time.perf_counter() - started

    def _schedule(self, request) -> None:
        self.calls.schedule_async_request(request)
        released(request)
        self.scheduled += 1

    def handed_over(self) -> None:
        """Every rank, before anything changes what a save in flight holds (the optimizer's update, a reload, the
        next save): its copy finished (training waits for what is left of it, counted as paused) and its request
        given to the writer."""
        copying, self.copying = self.copying, None
        if copying is None:
            return
        waited = time.perf_counter()
        self._schedule(copying.result())
        self.in_flight.blocked_s += time.perf_counter() - waited

    def _written(self, save: InFlight, complete: Callable) -> None:
        """Every rank, after Megatron-Core's finalization of a background write (its metadata): rank 0 hashes the
        files in a thread; the manifest and `latest` follow at the first poll after that."""
        self.hashing, self.complete = self._hash(save.checkpoint), complete

    def poll(self) -> None:
        """Every rank at the same point of every step: a finished background write is finalized now (Megatron-Core's
        metadata), and once rank 0 has hashed its files, completed (the manifest, `latest`)."""
        self.handed_over()
        save = self.in_flight
        if save is None:
            return
        save.poll_started = time.perf_counter()
        if self.hashing is None:
            self.calls.maybe_finalize_async_calls(blocking=False)
        if self.hashing is not None and reduced_flag(self.hashing.done(), "MIN"):
            files, self.hashing = self.hashing.result(), None
            self._complete(save, functools.partial(self.complete, files))
        else:
            save.blocked_s += time.perf_counter() - save.poll_started

    def _give_up(self) -> None:
        stop_writer(self.calls)

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
        if self.calls is None:
            return
        if self.copying is not None:  # its copy never reached the writer: nothing of it is being written
            self.copying = None
            log.warning("%s: this rank's copy of it was not handed to the writer; it stays without a manifest",
                        self.in_flight.checkpoint.name)
        else:
            self.wait_here(lambda: self.written.value >= self.scheduled)
        stop_writer(self.calls)


def _persist(step: int, rank: int, write, *args, **kwargs) -> None:
    """A background write, in this rank's writer process: the test faults of the `persist` phase, then the write."""
    faults.at_phase(step, "persist", rank)
    write(*args, **kwargs)
