"""Hang detection through a side channel: every rank's heartbeat thread bumps a counter in a TCPStore; a monitor
thread on each rank notices the ranks whose counter stopped moving (stopped, dead or frozen processes) and the
lowest live rank reports them and ends the job, while the collectives themselves keep their default timeouts.

Liveness is judged by counters seen to change on the monitor's own clock, so hosts need no clock synchronisation.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable


class Watchdog:
    def __init__(self, host: str, port: int, rank: int, world: int, deadline_s: float,
                 on_hang: Callable[[list[dict]], None], interval_s: float = 0.2):
        from torch.distributed import TCPStore

        self.rank, self.world, self.deadline_s, self.interval_s = rank, world, deadline_s, interval_s
        self.on_hang = on_hang
        make = lambda: TCPStore(host, port, world, is_master=False, timeout=__import__("datetime").timedelta(seconds=60))
        self._server = TCPStore(host, port, world, is_master=rank == 0, wait_for_workers=False) if rank == 0 else None
        self._beat_store, self._monitor_store, self.store = make(), make(), make()
        self.phase = "start"
        self._stop = threading.Event()
        self._seen: dict[int, tuple[int, float]] = {}

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def start(self) -> None:
        threading.Thread(target=self._beat, daemon=True, name="dmt-heartbeat").start()
        threading.Thread(target=self._monitor, daemon=True, name="dmt-monitor").start()

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        count = 0
        while not self._stop.is_set():
            count += 1
            self._beat_store.set(f"hb/{self.rank}", json.dumps({"n": count, "phase": self.phase, "pid": os.getpid()}))
            time.sleep(self.interval_s)

    def _read(self, rank: int) -> dict | None:
        key = f"hb/{rank}"
        if not self._monitor_store.check([key]):
            return None
        return json.loads(self._monitor_store.get(key))

    def _monitor(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            silent = []
            for rank in range(self.world):
                beat = self._read(rank)
                count = beat["n"] if beat else 0
                last_count, last_change = self._seen.get(rank, (-1, started))
                if count != last_count:
                    self._seen[rank] = (count, now)
                    continue
                if now - last_change > self.deadline_s:
                    silent.append({"rank": rank, "silent_s": round(now - last_change, 1),
                                   "last_phase": beat["phase"] if beat else "never started"})
            if silent:
                live = [r for r in range(self.world) if r not in {s["rank"] for s in silent}]
                if live and live[0] == self.rank:
                    self.on_hang(silent)
                os._exit(3)  # this job cannot finish; the collectives may never return
