"""Hang detection through a side channel (a TCPStore), leaving the process group's own timeout untouched.

Every rank runs a heartbeat thread that writes `beat/<rank>` every interval: a count that moves while the process
runs, the step the main thread is in (a collective sweep, the matmul, ...), and how many collectives it has issued
in that step (the process group's sequence number, as PyTorch's flight recorder uses it). A frozen process stops
the count; a rank stuck before a collective stops its step and collective count while the others wait for it.
Ranks 0 and 1 monitor all heartbeats on their own clock (no clock synchronisation between hosts) and judge them
with `find_unresponsive`; rank 0 reports (rank 1 when rank 0 itself went silent), and every rank then exits
non-zero instead of waiting for a collective that will never complete.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from toolkit.compat.torch_seams import collectives_issued

log = logging.getLogger(__name__)
PUBLISH_SPACING_S = 0.1  # a step entered is published at once, but at most this often however fast steps are
MONITOR_RANKS = (0, 1)  # two monitors: a stopped rank 0 is still named; more would only load the store
CLAIM_KEY, WRITTEN_KEY, ABORT_KEY = "report/claim", "report/written", "report/abort"


class LauncherTerminated(Exception):
    """SIGTERM: the launcher is ending the job (torchrun does when another rank failed)."""


def raise_terminated(signum, frame) -> None:
    """A SIGTERM handler: the main thread leaves what it was doing and reports (the job's failure report names who
    died first)."""
    raise LauncherTerminated("terminated by the launcher (SIGTERM), usually because another rank failed")


class Beat(NamedTuple):
    """One heartbeat: '<count> <step> <run|done|exit> <ops> <uniform> <step name>'."""

    count: int
    step: int
    finished: bool
    """'done': finished the check; 'exit': ended on purpose after a report (a hang or a failure elsewhere)."""
    ops: int
    """Collectives this rank issued since it entered the step."""
    uniform: bool
    """Every rank issues the same collectives in this step (not so for pairwise link tests)."""
    name: str


def parse_beat(value: bytes | str) -> Beat:
    text = value.decode() if isinstance(value, bytes) else value
    count, step, state, ops, uniform, name = (text.split(" ", 5) + [""])[:6]
    return Beat(int(count), int(step), state != "run", int(ops), uniform == "1", name)


@dataclass(frozen=True)
class Observation:
    """What a monitor knows about one rank."""

    rank: int
    host: str | None
    beat_age_s: float
    """Seconds since its heartbeat count last moved (since the monitor started when never seen)."""
    ever_seen: bool
    beat: Beat
    progress_age_s: float
    """Seconds since its step or its collective count last moved."""


def _entry(o: Observation, age: float, reason: str) -> dict:
    return {"rank": o.rank, "host": o.host, "step": o.beat.name, "silent_s": round(age, 1), "reason": reason}


STOPPED, NEVER_STARTED = "no heartbeat (process stopped, frozen or gone)", "never started"


def heartbeat_stopped(entry: dict) -> bool:
    """Whether find_unresponsive named this rank for its silent heartbeat (it cannot act on anything: a SIGTERM, the
    abort key, a report to write), rather than as alive but late."""
    return entry.get("reason") in (STOPPED, NEVER_STARTED)


def find_unresponsive(observations: list[Observation], deadline_s: float, stale_s: float | None = None,
                      startup_s: float | None = None) -> list[dict]:
    """The ranks to name, each with why; [] while the job is alive.

    1. a heartbeat stopped for longer than the deadline: the process is stopped, frozen or gone;
    2. ranks at the furthest step waited longer than the deadline: the ranks behind (not moving either) did not arrive;
    3. no rank moved for longer than the deadline, all in one step: in a step where every rank issues the same
       collectives, those that issued fewer did not arrive at the next one; otherwise the collective never completed.

    With `stale_s` (a few heartbeat periods): once 2. or 3. finds the job stuck, 1. holds with `stale_s` for the
    deadline: a rank frozen just after its last beat is otherwise named as merely late, because the others' wait
    began before its heartbeat went silent. With `startup_s`: 2. and 3. allow that long while a rank has not left
    the start (step -1: no step entered yet), which does work no step repeats.
    """
    active = [o for o in observations if not o.beat.finished]
    starting = startup_s is not None and any(o.beat.step < 0 for o in active)
    stuck = _stuck(active, startup_s if starting else deadline_s) if active else []
    silent_for = stale_s if stuck and stale_s is not None else deadline_s
    silent = [_entry(o, o.beat_age_s, STOPPED if o.ever_seen else NEVER_STARTED)
              for o in active if o.beat_age_s > silent_for]
    return silent or stuck


def _stuck(active: list[Observation], deadline_s: float) -> list[dict]:
    """2. and 3. of find_unresponsive."""
    frontier = max(o.beat.step for o in active)
    waiting = [o for o in active if o.beat.step == frontier]
    behind = [o for o in active if o.beat.step < frontier and o.progress_age_s > deadline_s]
    name = waiting[0].beat.name
    if behind and max(o.progress_age_s for o in waiting) > deadline_s:
        return [_entry(o, o.progress_age_s, f"did not arrive at '{name}' (alive, still in '{o.beat.name}')") for o in behind]
    if len(waiting) < len(active) or min(o.progress_age_s for o in waiting) <= deadline_s:
        return []
    most = max(o.beat.ops for o in waiting)
    if waiting[0].beat.uniform and any(o.beat.ops < most for o in waiting):
        return [_entry(o, o.progress_age_s, f"did not arrive at collective #{o.beat.ops + 1} of '{name}' "
                                            f"(alive; the other ranks issued {most})") for o in waiting if o.beat.ops < most]
    return [_entry(o, o.progress_age_s, f"'{name}' never completed on any rank (the network or a rank stuck inside it)")
            for o in waiting]


class LivenessTracker:
    """Turns successive heartbeat reads into Observations, on the reader's own monotonic clock."""

    def __init__(self, world: int, started: float):
        self.world, self.started = world, started
        self._seen: dict[int, tuple[int, float, tuple[int, int], float]] = {}  # rank -> (count, at, progress, at)

    def observe(self, beats: dict[int, Beat], hosts: list[str | None], now: float) -> list[Observation]:
        observations = []
        for rank in range(self.world):
            beat = beats.get(rank, Beat(0, -1, False, 0, True, "not started"))
            progress = (beat.step, beat.ops)
            previous = self._seen.get(rank)
            if previous is None:  # first sighting: it moved now; never seen: silent since the reader started
                moved = now if rank in beats else self.started
                entry = (beat.count, moved, progress, moved)
            else:
                entry = previous
                if beat.count != previous[0]:
                    entry = (beat.count, now, entry[2], entry[3])
                if progress != previous[2]:
                    entry = (entry[0], entry[1], progress, now)
            self._seen[rank] = entry
            observations.append(Observation(rank, hosts[rank] if rank < len(hosts) else None, now - entry[1],
                                            rank in beats, beat, now - entry[3]))
        return observations


def read_beats(store, world: int) -> dict[int, Beat]:
    """Every rank's last heartbeat that exists: one round trip once all ranks have written theirs."""
    keys = [f"beat/{r}" for r in range(world)]
    if store.check(keys):
        return {r: parse_beat(v) for r, v in enumerate(store.multi_get(keys))}
    return {r: parse_beat(store.get(k)) for r, k in enumerate(keys) if store.check([k])}


def read_hosts(store, world: int) -> list[str | None]:
    return [store.get(f"host/{r}").decode() if store.check([f"host/{r}"]) else None for r in range(world)]


def _collectives_issued() -> int:
    """The default process group's sequence number: collectives (and point-to-point ops) issued so far; 0 before
    the group exists. Read from the heartbeat thread: one integer, no communication."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return 0
        return collectives_issued(dist.group.WORLD)
    except Exception:  # a backend without sequence numbers: steps alone still localise a hang
        return 0


class Watchdog:
    """Heartbeat on every rank, monitor on ranks 0 and 1; `on_hang(unresponsive, store)` builds and emits the report
    (from the monitor thread, with that thread's store client)."""

    def __init__(self, store_factory: Callable[[], object], rank: int, world: int, host: str, deadline_s: float,
                 interval_s: float, on_hang: Callable[[list[dict], object], None], store_host_rank: int | None,
                 on_exit: Callable[[], None] | None = None, exit_code: int = 1, startup_s: float | None = None):
        self.rank, self.world, self.deadline_s, self.interval_s = rank, world, deadline_s, interval_s
        self.startup_s = startup_s  # the deadline before a rank's first step (find_unresponsive); None: deadline_s
        self.stale_s = min(max(5 * interval_s, 2.5), deadline_s)  # a heartbeat this old stopped (it beats each period)
        self.on_hang, self.store_host_rank = on_hang, store_host_rank
        self.on_exit, self.exit_code = on_exit, exit_code  # last words of a rank the watchdog ends, and its code
        self.store = store_factory()  # main thread's client; the threads get their own connections
        self._beat_store = store_factory()
        self._monitor_store = store_factory() if rank in MONITOR_RANKS else None
        self._step: tuple[int, str, bool, int] = (-1, "start", True, 0)  # index, name, uniform, sequence at entry
        self._stop = threading.Event()
        self._moved = threading.Event()  # the main thread entered a step: the heartbeat says so now, not later
        self._beats = 0
        self._threads: list[threading.Thread] = []
        self.tripped = threading.Event()
        self.store.set(f"host/{rank}", host)

    def step(self, name: str, uniform: bool = True) -> None:
        """The main thread enters its next step (`uniform`: every rank issues the same collectives in it)."""
        self._step = (self._step[0] + 1, name, uniform, _collectives_issued())
        self._moved.set()

    @property
    def step_name(self) -> str:
        return self._step[1]

    def start(self) -> None:
        self._publish("run")
        self._threads = [threading.Thread(target=self._beat, daemon=True, name="dmt-heartbeat")]
        if self._monitor_store is not None:
            self._threads.append(threading.Thread(target=self._monitor, daemon=True, name="dmt-monitor"))
        for thread in self._threads:
            thread.start()

    def finish(self) -> None:
        """Stop both threads and mark this rank done, so a monitor never mistakes a finished rank for a hung one."""
        self._halt()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5 * self.interval_s + 5)
        self._publish("done", self.store)

    def mark_exit(self, store=None) -> None:
        """Say this rank ends on purpose (after a report), so that no launcher counts it as died."""
        self._halt()
        try:
            self._publish("exit", store or self.store)
        except Exception as exc:
            log.debug("exit not marked: %s", exc)

    def _publish(self, state: str, store=None) -> None:
        self._beats += 1
        step, name, uniform, at_entry = self._step
        ops = max(0, _collectives_issued() - at_entry)
        (store or self._beat_store).set(f"beat/{self.rank}", f"{self._beats} {step} {state} {ops} {int(uniform)} {name}")

    def _halt(self) -> None:
        self._stop.set()
        self._moved.set()

    def _beat(self) -> None:
        while not self._stop.is_set():
            self._moved.wait(self.interval_s)
            self._moved.clear()
            if self._stop.is_set() or self._stop.wait(PUBLISH_SPACING_S):
                return
            try:
                self._publish("run")
                aborted = self._beat_store.check([ABORT_KEY])
            except Exception as exc:  # the store host may be stopped; the monitors judge that, not this thread
                log.debug("heartbeat not written: %s", exc)
                continue
            if aborted and not self._stop.is_set():  # another rank reported a hang or a failure: this job is over,
                self.mark_exit(self._beat_store)  # whatever collective this rank waits in (NCCL may wait 10 min)
                self._end()

    def read_beats(self, store=None) -> dict[int, Beat]:
        return read_beats(store or self.store, self.world)

    def hosts(self, store=None) -> list[str | None]:
        return read_hosts(store or self.store, self.world)

    def _monitor(self) -> None:
        store, tracker = self._monitor_store, LivenessTracker(self.world, time.monotonic())
        unreachable_since = None
        hosts: list[str | None] = [None] * self.world
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                beats = self.read_beats(store)
                if None in hosts:
                    hosts = self.hosts(store)
                unreachable_since = None
            except Exception:  # the store does not answer: its host (rank 0 without an agent store) is gone
                unreachable_since = unreachable_since or now
                if now - unreachable_since > self.deadline_s and self.store_host_rank not in (None, self.rank):
                    self._trip([{"rank": self.store_host_rank, "host": None, "step": None,
                                 "silent_s": round(now - unreachable_since, 1),
                                 "reason": "its TCPStore does not answer (process stopped, frozen or gone)"}], own=True)
                    return
                continue
            unresponsive = find_unresponsive(tracker.observe(beats, hosts, now), self.deadline_s, self.stale_s,
                                             self.startup_s)
            if unresponsive:
                stopped = {u["rank"] for u in unresponsive if heartbeat_stopped(u)}
                reporter = next((r for r in MONITOR_RANKS if r < self.world and r not in stopped), None)
                self._trip(unresponsive, own=reporter == self.rank)
                return

    def silent_ranks(self, window_s: float) -> list[int]:
        """Ranks whose heartbeat does not move during `window_s` (and that have not finished)."""
        first = self.read_beats()
        time.sleep(window_s)
        second = self.read_beats()
        return [r for r in range(self.world)
                if r not in second or (r in first and first[r].count == second[r].count and not second[r].finished)]

    def claim_report(self, store=None) -> bool:
        """True for the one rank that records the problem (first to claim), whichever check found it: incident.json
        in training, the health verdict under `dmt health`."""
        try:
            return int((store or self.store).add(CLAIM_KEY, 1)) == 1
        except Exception:
            return True  # no store: report locally rather than not at all

    def wait_for_report(self, timeout_s: float = 10.0, store=None) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                if (store or self.store).check([WRITTEN_KEY]):
                    return
            except Exception:
                return
            time.sleep(0.05)

    def report_written(self, store=None) -> None:
        """The failure report is out: every rank still running ends (see _beat)."""
        try:
            (store or self.store).set(WRITTEN_KEY, "1")
            (store or self.store).set(ABORT_KEY, "1")
        except Exception as exc:
            log.debug("could not mark the report written: %s", exc)

    def _trip(self, unresponsive: list[dict], own: bool) -> None:
        """End this rank: the reporter reports first; the collective it is blocked in may never return."""
        self.tripped.set()
        store = self._monitor_store
        if own and self.claim_report(store):
            try:
                self.on_hang(unresponsive, store)
            except Exception:  # still end the job: a hung job that says nothing is worse
                log.exception("the hang report failed")
            finally:
                self.report_written(store)
        else:
            self.wait_for_report(store=store)
        self.mark_exit(store)
        self._end()

    def _end(self) -> None:
        if self.on_exit is not None:
            try:
                self.on_exit()
            except Exception:  # the exit matters more than its last words
                log.exception("before exiting")
        exit_now(self.exit_code)


# What a rank must undo however it ends: run by exit_now (which skips the interpreter's exit handlers) and registered
# with atexit by whoever adds one (see on_exit)
_ON_EXIT: list[Callable[[], None]] = []


def on_exit(cleanup: Callable[[], None]) -> None:
    """Run `cleanup` when this rank ends, by exit_now (a completed launch under train.py, a failure, a hang) or by
    the interpreter's own exit; it runs once, and must not raise."""
    import atexit

    def once() -> None:
        if cleanup in _ON_EXIT:
            _ON_EXIT.remove(cleanup)
            cleanup()

    _ON_EXIT.append(cleanup)
    atexit.register(once)


def exit_now(code: int = 1) -> None:
    """End this rank without the interpreter's teardown (it can hang or abort in a library's threads), taking its
    multiprocessing children with it: the exit handler that would stop them does not run on os._exit, and one of them
    (the Manager process Megatron-Core's dist_checkpointing starts for its write results, filesystem_async.py) would
    outlive the rank for ever, holding its memory."""
    import multiprocessing

    for cleanup in list(_ON_EXIT):
        _ON_EXIT.remove(cleanup)
        try:
            cleanup()
        except Exception:  # the rank is ending: a failed cleanup is logged, never a second failure
            log.exception("cleanup at exit")
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout=2.0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
