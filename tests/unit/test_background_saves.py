"""The pause a background save costs while training waits for it (toolkit.backends.background_saves.BackgroundSaves
.wait): measured, not counted in poll intervals. Judged by what the code guarantees (the intervals it measures lie
inside the wait; a clock whose sleeps last longer than asked is followed exactly), never by how fast this machine is."""

import threading
import time

import pytest

from toolkit.backends import background_saves
from toolkit.backends.background_saves import BackgroundSaves, InFlight
from toolkit.runtime.metrics import MetricsWriter, read_checkpoint_records
from toolkit.runtime.supervision import TrainingWatchdog

MANIFEST = {"files": {"model.bin": {"bytes": 8, "sha256": "0"}}}


class ThreadSaves(BackgroundSaves):
    """A save written by a thread of this process that holds the GIL while it works (as a writer serializing under
    the GIL does): each sleep of the wait then lasts longer than asked."""

    def __init__(self, metrics, watch, work_s: float):
        super().__init__(metrics, watch, wait_s=60)
        self.writer = threading.Thread(target=_busy, args=(work_s,))

    def start(self, step: int, checkpoint) -> None:
        self.in_flight = InFlight(step, checkpoint, started=time.perf_counter())
        self.writer.start()

    def poll(self) -> None:
        save = self.in_flight
        save.poll_started = time.perf_counter()
        if not self.writer.is_alive():
            self._complete(save, lambda: {"step": save.step, **MANIFEST})
        else:
            save.blocked_s += time.perf_counter() - save.poll_started


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(1000))


def test_a_wait_counts_the_time_training_really_waited(tmp_path):
    saves = ThreadSaves(MetricsWriter(tmp_path, 1), TrainingWatchdog(tmp_path, 0), work_s=1.0)
    saves.start(4, tmp_path / "checkpoint-4")
    before = time.perf_counter()
    saves.wait(5)
    waited = time.perf_counter() - before
    assert saves.in_flight is None
    [record] = read_checkpoint_records(tmp_path)
    assert record["step"] == 4 and record["async"]
    # the save completes only once its writer has worked its 1 s, which began after the save started
    assert record["persist_s"] >= 1.0
    # the recorded pause is made of intervals inside the wait (both clocks are CLOCK_MONOTONIC on Linux), and the
    # save's own part before the wait is nil here; how much of the wait they cover depends on the machine's load,
    # which test_the_pause_follows_the_clock_not_the_poll_count takes out
    assert record["persist_s"] >= record["blocking_s"] > 0 and record["blocking_s"] <= waited


class Clock:
    """A clock whose sleeps last `oversleep` times what they ask (a loaded machine, a writer holding the GIL), and
    whose every poll of the writer costs `poll_s`: the time the wait must record is then known exactly."""

    def __init__(self, oversleep: float):
        self.now, self.oversleep = 1000.0, oversleep

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        self.now += seconds * self.oversleep


class ClockedSaves(BackgroundSaves):
    """A save whose writer finishes after `polls` polls of the wait, each taking `poll_s` of `clock`'s time."""

    def __init__(self, metrics, watch, clock: Clock, polls: int, poll_s: float):
        super().__init__(metrics, watch, wait_s=60)
        self.clock, self.polls_left, self.poll_s = clock, polls, poll_s

    def poll(self) -> None:
        save = self.in_flight
        save.poll_started = self.clock.perf_counter()
        self.clock.now += self.poll_s
        self.polls_left -= 1
        if self.polls_left == 0:
            self._complete(save, lambda: {"step": save.step, **MANIFEST})
        else:
            save.blocked_s += self.clock.perf_counter() - save.poll_started


def test_the_pause_follows_the_clock_not_the_poll_count(tmp_path, monkeypatch):
    """Every sleep of the wait lasts 3x POLL_S: a pause counted in poll intervals would record a third of the sleeps."""
    clock = Clock(oversleep=3.0)
    monkeypatch.setattr(background_saves, "time", clock)
    saves = ClockedSaves(MetricsWriter(tmp_path, 1), TrainingWatchdog(tmp_path, 0), clock, polls=7, poll_s=0.01)
    saves.in_flight = InFlight(4, tmp_path / "checkpoint-4", started=clock.now - 0.5)  # started 0.5 s before the wait
    saves.wait(5)
    [record] = read_checkpoint_records(tmp_path)
    # 7 polls of 0.01 s and the 6 sleeps between them, 0.15 s each
    assert record["blocking_s"] == pytest.approx(7 * 0.01 + 6 * 3 * background_saves.POLL_S)
    assert record["persist_s"] == pytest.approx(0.5 + record["blocking_s"])
