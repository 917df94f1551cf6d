"""The toolkit's rules around a checkpoint written in the background, whatever writes it (Megatron-Core's persistent
writer, toolkit.backends.megatron.saves; torch.distributed.checkpoint.async_save under the HF Trainer,
toolkit.backends.hf_saves):

- a checkpoint becomes visible only once complete: every rank polls at the same point of each step (one collective
  while a save is in flight), and only when every rank's write has finished does the completion (the manifest, then
  `latest`, rank 0) run, from the training processes, never from a writer;
- at most one save in flight: the next save and the end of training (after a scheduler's save-and-exit too) wait for
  it, at most `wait_s` (every rank gives up together; the log names the checkpoint and the run fails: `latest` stays
  on the checkpoint before); the watchdog's exit waits for this rank's write as long, without collectives, and leaves
  the checkpoint without a manifest (`dmt ckpt verify` rejects it, a restart resumes from `latest`);
- every complete checkpoint gets its metrics.jsonl record (toolkit.backends.loop.write_checkpoint_record): the time
  training was paused for it (the save's own part, the polls that finished it, any wait for it) and the time until
  it was complete.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from toolkit.backends.loop import reduced_flag, write_checkpoint_record
from toolkit.checkpoint.manifest import hash_files
from toolkit.spec.recipe_training import TrainingSection

log = logging.getLogger(__name__)
POLL_S = 0.05  # between the polls of a wait


def save_wait_s(recipe) -> float:
    """How long a save waits for the one in flight: the hang timeout, which every save must fit in anyway (its
    default where the watchdog is off)."""
    return recipe.training.hang_timeout_s or TrainingSection.model_fields["hang_timeout_s"].default


def in_thread(name: str, function: Callable, *args) -> Future:
    """`function(*args)` in a thread of its own (named `name`) while training goes on: its result or its exception
    comes back through the Future."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    done = pool.submit(function, *args)
    pool.shutdown(wait=False)
    return done


class CheckpointNotWritten(RuntimeError):
    """A background write did not finish within the wait."""


@dataclass
class InFlight:
    step: int
    checkpoint: Path
    started: float  # when training paused for it
    blocked_s: float = 0.0  # pauses for it so far
    poll_started: float = 0.0


class BackgroundSaves:
    """One per rank. `metrics` is rank 0's MetricsWriter (None elsewhere); `watch` its TrainingWatchdog. A subclass
    polls its writer (`poll`: every rank, the same steps; it calls `_complete` once every rank's write is done) and
    gives a save up (`_give_up`)."""

    def __init__(self, metrics, watch, wait_s: float):
        self.metrics, self.watch, self.wait_s = metrics, watch, wait_s
        self.in_flight: InFlight | None = None

    def poll(self) -> None:
        raise NotImplementedError

    def _give_up(self) -> None:
        """The save in flight is abandoned (every rank, after the bounded wait)."""

    def wait(self, step: int) -> None:
        """Every rank: the save in flight completed, at most `wait_s` from now."""
        save = self.in_flight
        if save is None:
            return
        waited_from, blocked_before = time.monotonic(), save.blocked_s

        self.watch.phase(step, "save-wait")
        deadline = waited_from + self.wait_s
        while True:
            self.poll()
            if self.in_flight is None:
                return
            if reduced_flag(time.monotonic() > deadline, "MAX"):  # every rank gives up at the same poll
                log.error("%s: its background write did not finish within %.0f s; abandoned (latest stays on the "
                          "checkpoint before)", save.checkpoint.name, self.wait_s)
                self._give_up()
                self.in_flight = None
                raise CheckpointNotWritten(f"{save.checkpoint.name} was not written within {self.wait_s:.0f} s")
            time.sleep(POLL_S)
            # the whole wait so far, as measured: a sleep lasts longer than asked on a loaded machine, and the polls
            # and their collective take time too (each poll's own addition is included here, not added twice)
            save.blocked_s = blocked_before + time.monotonic() - waited_from

    def wait_here(self, finished: Callable[[], bool]) -> None:
        """The watchdog ends this rank: its write in progress may finish (at most `wait_s`, no collective); the
        checkpoint stays without a manifest (the other ranks did not agree it was complete)."""
        save, deadline = self.in_flight, time.monotonic() + self.wait_s
        while save is not None and not finished() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if save is not None:
            done = finished()
            (log.warning if done else log.error)(
                "%s: %s; it stays without a manifest", save.checkpoint.name,
                "this rank's background write finished" if done else
                f"this rank's background write did not finish within {self.wait_s:.0f} s and is abandoned")

    def _hash(self, checkpoint: Path) -> Future:
        """Rank 0 (the one with `metrics`), once every rank's files are written: the manifest's hashes, taken in a
        thread (hashlib and file reads release the GIL), so that training goes on meanwhile; a finished None
        elsewhere."""
        if self.metrics is None:
            done: Future = Future()
            done.set_result(None)
            return done

        return in_thread("dmt-manifest-hash", hash_files, checkpoint)

    def _complete(self, save: InFlight, complete: Callable, asynchronous: bool = True) -> None:
        """Every rank, once every rank's files of `save` are written: `complete()` writes the manifest and moves
        `latest` (rank 0, which gets the manifest back), then the checkpoint's record."""
        manifest = complete()
        now = time.perf_counter()
        self.in_flight = None
        if self.metrics is not None:
            write_checkpoint_record(self.metrics, manifest, save.checkpoint, save.blocked_s + now - save.poll_started,
                                    now - save.started, asynchronous)
