"""The HF Trainer's checkpoints written in the background (training.async_save, on a backend that saves so: FSDP2,
whose model and optimizer state go through torch.distributed.checkpoint.async_save, toolkit.compat.dcp_async), with
the toolkit's rules around them (toolkit.backends.background_saves).

The Trainer's save runs as ever (trainer state, RNG, scheduler, the model's config: small files, written before it
returns); only the DCP directories are written by a thread of each rank after the state is copied. Once every rank's
writes have finished, rank 0 hashes the checkpoint's files in a thread as well; the manifest and `latest` follow at the
start of the first step after that.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from toolkit.backends.background_saves import BackgroundSaves, InFlight
from toolkit.backends.loop import reduced_flag
from toolkit.compat.dcp_async import GroupPool, dcp_saves_in_background
from toolkit.runtime import faults

log = logging.getLogger(__name__)


class TrainerSaves(BackgroundSaves):
    """One per rank (every rank of an HF Trainer run whose checkpoints are written in the background)."""

    def __init__(self, metrics, watch, wait_s: float, rank: int):
        super().__init__(metrics, watch, wait_s)
        self.rank = rank
        self.groups = GroupPool()
        self.writes: list = []  # the futures of the save in flight (one per DCP directory)
        self.staging: list = []  # their staging futures: the state may change once these are done
        self.complete: Callable | None = None  # its manifest and `latest`, once every rank's writes are done
        self.hashing: Future | None = None  # rank 0's hashing of its files (a finished None elsewhere)
        watch.before_exit(self.abandon)

    @contextlib.contextmanager
    def writing(self, step: int):
        """Around the Trainer's save of the model and optimizer state (every rank): the save before it complete
        first; its DCP directories then written in the background."""
        self.wait(step)
        self.watch.phase(step, "save")
        self.writes, self.staging = [], []
        with dcp_saves_in_background(self.groups, self.writes, self.staging,
                                     functools.partial(_persist, step, self.rank)):
            yield

    def before_optimizer_step(self) -> None:
        """Every rank, before the optimizer changes the parameters and its state: the save's copy of them finished
        (made in the background while this step's forward and backward ran); the wait is a pause of training."""
        if not self.staging:
            return
        started = time.perf_counter()
        for staged in self.staging:
            staged.result()
        self.staging = []
        if self.in_flight is not None:
            self.in_flight.blocked_s += time.perf_counter() - started

    def saved(self, step: int, checkpoint: Path, started: float, complete: Callable) -> None:
        """The Trainer's save returned (every rank); `started` is when training paused for it; `complete()` writes
        the manifest and `latest` once every rank's writes are done (rank 0 returns the manifest)."""
        if not self.writes:  # the Trainer's save did not go through writing() and Accelerate's DCP save
            raise RuntimeError(f"training.async_save: the HF Trainer's save of {checkpoint.name} wrote nothing in the "
                               f"background (its files were written synchronously)")
        now = time.perf_counter()
        self.in_flight = InFlight(step, checkpoint, started, blocked_s=now - started)
        self.complete = complete
        log.info("%s: written in the background (%d DCP directories)", checkpoint.name, len(self.writes))

    def poll(self) -> None:
        """Every rank at the start of every step: once every rank's writes have finished, rank 0 hashes the files in
        a thread; once that is done, the manifest and `latest` (from this, the training thread)."""
        save = self.in_flight
        if save is None:
            return
        save.poll_started = time.perf_counter()
        if self.hashing is None and reduced_flag(all(write.done() for write in self.writes), "MIN"):
            for write in self.writes:
                write.result()  # a write that failed fails the run here, on its rank
            self.writes = []
            self.hashing = self._hash(save.checkpoint)
        if self.hashing is not None and reduced_flag(self.hashing.done(), "MIN"):
            files, self.hashing = self.hashing.result(), None
            self._complete(save, functools.partial(self.complete, files))
        else:
            save.blocked_s += time.perf_counter() - save.poll_started

    def close(self, step: int) -> None:
        """Every rank at the end of training (after a scheduler's save-and-exit too): the save in flight completed."""
        self.wait(step)

    def abandon(self) -> None:
        """This rank is ended by the watchdog: its writes may finish (at most `wait_s`); no manifest either way (the
        writing threads end with the process)."""
        self.wait_here(lambda: all(write.done() for write in self.writes))


def _persist(step: int, rank: int) -> None:
    """In a writing thread, before its first byte: the test faults of the `persist` phase."""
    faults.at_phase(step, "persist", rank)
