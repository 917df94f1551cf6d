"""The watchdog during training, for every backend: `dmt health`'s heartbeats and monitors (toolkit.runtime.watchdog)
on every rank of the job, through the job's own TCPStore (torchrun's agent store, or rank 0's under deepspeed).

The backends call `phase(step, name)` as each rank enters a phase of a step (train, save, manifest, log). A rank
whose heartbeat stops for `training.hang_timeout_s` (stopped, frozen, gone), or a phase no rank leaves for that long
(a collective that never completes, a rank that never arrives; before the first step, STARTUP_FACTOR times as
long), is named in OUTPUT/incident.json (rank, host, pid,
step, phase) by one monitor; every rank still running then writes its Python stacks (and on NCCL the flight
recorder's record) under OUTPUT/incident/ and exits with code 3, so that the launcher or Slurm restarts the job.
A rank that raises reports the failure the same way (naming the ranks whose heartbeat stopped) and ends the job
at once, instead of leaving the others waiting in a collective.

A checkpoint being written when the job ends stays incomplete-looking: its manifest is written only after every
rank's files, and `latest` moves only after the manifest (toolkit.checkpoint.manifest).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from toolkit.errors import UserInputError
from toolkit.readers import read_text
from toolkit.runtime import faults, ftmonitor, inprocess
from toolkit.runtime.guard import GuardStop
from toolkit.runtime.incident import (
    EXIT_FAILURE,
    EXIT_HANG,
    analyse_collectives,
    append_incident,
    attempt_tag,
    is_restart,
    last_words_dir,
    read_incidents,
    restart_counts,
    write_last_words,
)
from toolkit.runtime.job import connect_store, rank_env
from toolkit.runtime.watchdog import Watchdog, exit_now, heartbeat_stopped, raise_terminated
from toolkit.spec.recipe_training import STARTUP_FACTOR, heartbeat_interval_s

log = logging.getLogger(__name__)
_PHASE = re.compile(r"^step (\d+) (.+)$")  # a heartbeat's step name, as phase() writes it
KILL_DELAY_S = 3.0  # after the hang report, before the silent rank on the reporter's host is SIGKILLed (kill_later)
LATEST_POINTER = "latest"  # OUTPUT/latest names the newest complete checkpoint (toolkit.checkpoint.manifest)
SAVE_AND_EXIT = "SAVE_AND_EXIT"  # the file a scheduler's USR1 handler touches in the output directory (slurm.sbatch)


def where(name: str | None) -> tuple[int | None, str | None]:
    """(step, phase) of a heartbeat's step name."""
    match = _PHASE.match(name or "")
    return (int(match.group(1)), match.group(2)) if match else (None, name)


def latest_name(output_dir: Path) -> str | None:
    path = Path(output_dir) / LATEST_POINTER
    if not os.path.lexists(path):
        return None
    try:
        return read_text(path).strip() or None
    except UserInputError:  # not a regular file, too large, not text: no pointer to report
        return None


class TrainingWatchdog:
    """One per rank. Inactive (phases still count for fault injection) with hang_timeout_s 0, outside a launcher,
    or on a single rank, which has no peer to wait for and no other process to report it."""

    def __init__(self, output_dir: Path, hang_timeout_s: float):
        self.output_dir, self.timeout = Path(output_dir), hang_timeout_s
        self.env = rank_env()
        self.rank = self.env.rank if self.env else 0
        self.watchdog = None
        self._previous_term = None
        self._exit_hooks: list[Callable[[], None]] = []
        self._dumps_expected: int | None = None  # set by the hang report on the rank that writes it

    @property
    def interval_s(self) -> float:
        """Heartbeat and monitor period."""
        return heartbeat_interval_s(self.timeout)

    def start(self) -> None:
        """Every rank, once the process group exists (under deepspeed, rank 0 hosts the store from then on)."""
        from torch.distributed import PrefixStore

        ftmonitor.start(self.output_dir, self.timeout)  # under ft_launcher: NVRx's rank monitor watches (else a no-op)
        if self.timeout <= 0 or self.env is None or self.env.world_size < 2 or self.watchdog is not None:
            return
        env, prefix = self.env, f"dmt-train/{attempt_tag()}"  # a restart's heartbeats are not the last attempt's
        side_timeout = max(2.0, min(self.timeout / 2, 30.0))
        factory = lambda: PrefixStore(prefix, connect_store(env, side_timeout, master=False))  # noqa: E731
        self.watchdog = Watchdog(factory, env.rank, env.world_size, env.host, self.timeout, self.interval_s,
                                 self._report_hang, store_host_rank=None if env.agent_store else 0,
                                 on_exit=self._last_words, exit_code=EXIT_HANG,
                                 startup_s=STARTUP_FACTOR * self.timeout)
        self.watchdog.store.set(f"pid/{env.rank}", str(os.getpid()))
        self.watchdog.start()
        self._previous_term = signal.signal(signal.SIGTERM, raise_terminated)

    def phase(self, step: int, name: str) -> None:
        if self.watchdog is not None:
            self.watchdog.step(f"step {step} {name}")
        ftmonitor.phase(step, name)  # under ft_launcher: a heartbeat and a section to NVRx's rank monitor
        inprocess.ping()  # training.restart: in_process: NVRx's progress timeout (a no-op otherwise)
        faults.at_phase(step, name, self.rank, wake=self.output_dir / SAVE_AND_EXIT)

    def finish(self) -> None:
        """This rank ends normally (done, or stopped by the guard together with every other rank)."""
        ftmonitor.stop()
        if self.watchdog is None:
            return
        signal.signal(signal.SIGTERM, self._previous_term or signal.SIG_DFL)
        self.watchdog.finish()
        self.watchdog = None

    def fail(self, exc: BaseException, code: int = EXIT_FAILURE, line: str | None = None,
             before_exit: Callable[[], None] | None = None) -> None:
        """This rank raised: report it once for the job (naming the ranks whose heartbeat stopped, e.g. the one a
        SIGKILL ended before the launcher's SIGTERM reached this one), end the other ranks, and exit with `code`
        now (destroying a process group with a dead peer can block). `before_exit` runs after the report, still
        shielded from the launcher's SIGTERM (the caller's own record of the failure)."""
        watchdog = self.watchdog
        if watchdog is None:  # no peers to end: the caller raises as usual
            return
        self.shield()
        if line is not None:
            print(line, file=sys.stderr)
        else:
            traceback.print_exception(exc)
        if watchdog.tripped.is_set():  # the monitor is already reporting a hang and will end this process
            time.sleep(self.timeout + 30)
        elif watchdog.claim_report():
            try:  # the store may be gone with its host (rank 0 under deepspeed): then nobody is named
                died = self._ranks(watchdog.silent_ranks(min(max(3 * self.interval_s, 1.5), 15.0)), watchdog.store)
            except Exception:
                died = None
            step, phase = where(watchdog.step_name)
            first = (str(exc).splitlines() or [""])[0][:300]
            reason = f"rank {self.rank} ({self.env.host}) at step {step}, phase {phase}: {type(exc).__name__}: {first}"
            append_incident(self.output_dir, {"event": "failure", "reason": reason, "died": died,
                                              "reported_by": self.rank, "latest": latest_name(self.output_dir),
                                              "last_words": str(last_words_dir(self.output_dir))})
            watchdog.report_written()
        else:
            watchdog.wait_for_report()
        if before_exit is not None:
            try:
                before_exit()
            except Exception:
                log.exception("after the failure report")
        watchdog.mark_exit()
        self._last_words()
        exit_now(code)

    def shield(self) -> None:
        """This rank is failing: from now on the launcher's SIGTERM (torchrun's, once it sees a peer die) no longer
        raises, so it cannot cut short the failure report, the exit hooks (a background write's bounded wait) or the
        last words; the launcher's SIGKILL after its grace period still ends the process. The first thing a
        failure handler does: a SIGTERM arriving while the traceback is printed lost the report before."""
        if self.watchdog is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def _ranks(self, ranks: list[int], store, reasons: dict[int, dict] | None = None) -> list[dict]:
        """Who they are: host, pid and where their last heartbeat said they were."""
        watchdog = self.watchdog
        try:
            beats, hosts = watchdog.read_beats(store), watchdog.hosts(store)
        except Exception:  # the store itself is what stopped answering
            beats, hosts = {}, [None] * watchdog.world
        named = []
        for rank in ranks:
            entry = dict((reasons or {}).get(rank, {}))
            step, phase = where(beats[rank].name if rank in beats else entry.get("step"))
            try:
                pid = int(store.get(f"pid/{rank}"))
            except Exception:
                pid = None
            named.append({"rank": rank, "host": entry.get("host") or hosts[rank], "pid": pid, "step": step,
                          "phase": phase, **{k: v for k, v in entry.items() if k in ("silent_s", "reason")}})
        return named

    def _report_hang(self, unresponsive: list[dict], store) -> None:
        named = self._ranks([u["rank"] for u in unresponsive], store, {u["rank"]: u for u in unresponsive})
        for entry in named:
            log.error("hang: rank %s (%s, pid %s) at step %s, phase %s: %s for %.0f s; ending the job",
                      entry["rank"], entry["host"], entry["pid"], entry["step"], entry["phase"],
                      entry.get("reason"), entry.get("silent_s") or 0)
        # under ft_launcher NVRx's rank monitor ends a silent rank itself (SIGCONT, then ft_config.yaml's SIGKILL, once
        # its heartbeat timeout, at most hang_timeout_s, has passed): the toolkit's own kill is torchrun's and the
        # deepspeed launcher's only
        ended = [] if ftmonitor.under_ft_launcher() else [
            e for e in named if e["pid"] and e["host"] == self.env.host and e["pid"] != os.getpid()
            and heartbeat_stopped(e)]
        for entry in ended:
            entry["ended_by_watchdog"] = "SIGKILL"
        # its last words add torch's analysis of the collectives, from every rank but the frozen ones' dumps
        self._dumps_expected = self.env.world_size - sum(1 for e in named if heartbeat_stopped(e))
        append_incident(self.output_dir, {"event": "hang", "unresponsive": named, "reported_by": self.rank,
                                          "hang_timeout_s": self.timeout, "latest": latest_name(self.output_dir),
                                          "last_words": str(last_words_dir(self.output_dir))})
        if ended:
            log.error("hang: SIGKILL to the silent rank(s) %s on this host in %.0f s", [e["rank"] for e in ended],
                      KILL_DELAY_S)
            kill_later([e["pid"] for e in ended], KILL_DELAY_S)

    def before_exit(self, hook: Callable[[], None]) -> None:
        """`hook` runs when the watchdog ends this rank (a hang, a failure), before its last words: bounded, and
        without collectives (a peer may be gone)."""
        self._exit_hooks.append(hook)

    def _last_words(self) -> None:
        for hook in self._exit_hooks:
            try:
                hook()
            except Exception:
                log.exception("on the way out")
        write_last_words(self.output_dir, self.rank)
        if self._dumps_expected is not None:  # the reporter names the collective once the ranks' dumps are in
            append_incident(self.output_dir, analyse_collectives(self.output_dir, self.env.world_size,
                                                                 self._dumps_expected))


def kill_later(pids: list[int], delay_s: float) -> None:
    """SIGKILL `pids` after `delay_s`, from a detached shell that outlives this process.

    A rank whose heartbeat stopped (SIGSTOPped, or blocked in native code with the GIL held) never acts on the
    launcher's SIGTERM, so torchrun and the deepspeed launcher would each wait their 30 s grace before their own
    SIGKILL, and only then restart the job. The delay lets the launcher see the reporter's exit code (3, a hang)
    before the silent rank's -9 (the deepspeed launcher polls once a second and exits with the first failure it sees).
    """
    import subprocess

    targets = " ".join(str(int(pid)) for pid in pids)
    subprocess.Popen(["/bin/sh", "-c", f"sleep {delay_s}; kill -KILL {targets} 2>/dev/null"], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def record_restart(output_dir: Path, resume_from: str | None) -> None:
    """On a restarted launch (rank 0): why the previous attempt ended and where this one continues. A run the guard
    stopped is not restarted: the same data would stop it again (GuardStop, exit code 4)."""
    if not is_restart():
        return
    # what ended the last attempt: its last event but the flight recorder's analysis, which follows a hang's report
    previous = [e for e in read_incidents(output_dir) if e.get("attempt") != restart_counts()
                and e.get("event") != "collectives"]
    ending = previous[-1] if previous else {}  # what ended the last attempt, when the toolkit could say
    fatal = ending.get("event") in ("hang", "failure") or (ending.get("event"), ending.get("action")) == ("guard", "stop")
    cause = ending if fatal else None
    if cause is not None and cause.get("event") == "guard" and cause.get("action") == "stop":
        raise GuardStop(f"not restarting: the guard stopped this run at step {cause.get('step')} "
                        f"({cause.get('reason')}); resume by hand with --resume latest once it is fixed")
    if os.environ.get("RANK", "0") == "0":
        append_incident(output_dir, {"event": "restart", "resume_from": resume_from, "cause": cause or (
            "the previous attempt ended without a report from the toolkit: a rank killed (SIGKILL, out of memory) "
            "before it could report, or its node lost; the launcher's log has the exit code")})
