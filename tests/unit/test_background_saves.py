"""The pause a background save costs while training waits for it (toolkit.backends.background_saves.BackgroundSaves
.wait): measured, not counted in poll intervals."""

import threading
import time

from toolkit.backends.background_saves import BackgroundSaves, InFlight
from toolkit.runtime.metrics import MetricsWriter, read_checkpoint_records
from toolkit.runtime.supervision import TrainingWatchdog


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
            self._complete(save, lambda: {"step": save.step, "files": {"model.bin": {"bytes": 8, "sha256": "0"}}})
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
    assert waited > 0.9
    # the recorded pause is the wait as the clock saw it (the save's own part before the wait is nil here)
    assert abs(record["blocking_s"] - waited) < 0.02, (record["blocking_s"], waited)
    assert record["persist_s"] >= record["blocking_s"]
