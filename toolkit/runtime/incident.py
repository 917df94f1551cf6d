"""OUTPUT/incident.json: the faults of a training job, one event each, appended by the one rank that reports it, and
the last words of every rank the job ends (its Python stacks; on NCCL the flight recorder's record of collectives).

incident.json is {"events": [...]}, oldest first. Every event has `event`, `time` (UTC, ISO 8601) and `attempt`
(restarts before this launch: {"torchrun", "launch", "slurm", "in_process"}), and by kind:
  hang     unresponsive [{rank, host, pid, step, phase, silent_s, reason}], reported_by, latest (the checkpoint
           `latest` named when it happened), last_words (the directory of the ranks' stacks and NCCL traces)
  failure  reason (the reporting rank's error line), died [{rank, host, pid, step, phase}], reported_by, latest,
           last_words
  guard    step, action (stop | skip | rollback), reason, loss, median, data_sha; a rollback adds checkpoint (what
           was reloaded) and dropped_steps [first, last]
  restart  resume_from (the checkpoint this attempt continues from, or null), cause (the event that ended the
           previous attempt, or why there is none)
  local_resume  (checkpoint.local) step (the node-local checkpoint every rank held, newer than `latest`, that the
           resume read instead), dir (checkpoint.local.dir), persistent (the checkpoint `latest` named, or null)
  resumed  (training.restart: in_process) step (the first step trained after the restart), restart_s (from the
           failure, as the surviving rank 0 saw it, to the end of that step), pid (rank 0's: unchanged), iteration
  collectives  after a hang, from the reporting rank once the ranks' last words are written: torch's flight
           recorder analysis of their dumps (torch.distributed.flight_recorder): recorder (on | off, and why),
           dumps (ranks whose dump arrived), collective and missing_ranks (the first collective not every rank joined,
           as torch's analyser names it; null when it names none), analysis (its report, line by line)
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from pathlib import Path

from toolkit.compat.torch_seams import flight_recorder_dump, nccl_trace_dump
from toolkit.errors import UserInputError
from toolkit.outputs import write_file
from toolkit.readers import read_json

log = logging.getLogger(__name__)
INCIDENT_FILE = "incident.json"
LAST_WORDS_DIR = "incident"  # OUTPUT/incident/attempt-<tag>/rank<R>.stacks.txt, rank<R>.nccl_trace.pkl
FR_DUMP_PREFIX = "fr_trace_rank_"  # OUTPUT/incident/attempt-<tag>/fr_trace_rank_<R>: the flight recorder's dump
FR_BUFFER = "2000"  # collectives each rank's flight recorder keeps (torch's ring buffer)
FR_WAIT_S = 10.0  # how long the reporting rank waits for the other ranks' dumps before it analyses those it has
# Exit codes of a training rank (bad input is 2, as for every command)
EXIT_FAILURE, EXIT_HANG, EXIT_GUARD_STOP = 1, 3, 4
# launcher -> the variable that counts its restarts of this job
RESTART_COUNTERS = {"torchrun": "TORCHELASTIC_RESTART_COUNT", "launch": "DMT_RESTART_COUNT",
                    "slurm": "SLURM_RESTART_COUNT", "in_process": "DMT_INPROCESS_RESTART"}


def restart_counts(environ=None) -> dict[str, int]:
    environ = os.environ if environ is None else environ
    counts = {}
    for launcher, name in RESTART_COUNTERS.items():
        value = environ.get(name, "")
        counts[launcher] = int(value) if value.isdigit() else 0
    return counts


def attempt_tag(environ=None) -> str:
    """One name per launch of the job: every restart, of whichever launcher, gets a new one."""
    counts = restart_counts(environ)
    return "-".join(str(counts[launcher]) for launcher in RESTART_COUNTERS)


def is_restart(environ=None) -> bool:
    return any(restart_counts(environ).values())


def read_incidents(output_dir: Path) -> list[dict]:
    """The events so far; [] when there are none or the file cannot be read (it is a log, not an input)."""
    path = Path(output_dir) / INCIDENT_FILE
    try:
        # the toolkit's own log, written with json.dumps (which writes a non-finite float as NaN/Infinity): should an
        # event hold one, the finite-number rule would read the log as empty and the next event overwrite the others
        events = read_json(path, what="the incident log", finite=False).get("events") \
            if os.path.lexists(path) else None
    except UserInputError:
        return []
    return events if isinstance(events, list) else []


def append_incident(output_dir: Path, event: dict) -> dict:
    """Append one event (with its time and attempt) and rewrite the file whole; never raises: a fault report that
    fails must not hide the fault, so the event is logged in any case."""
    event = {"event": event["event"], "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "attempt": restart_counts(), **{k: v for k, v in event.items() if k != "event"}}
    log.error("incident: %s", json.dumps(event, default=str))
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        events = read_incidents(output_dir) + [event]
        write_file(Path(output_dir) / INCIDENT_FILE, json.dumps({"events": events}, indent=2, default=str) + "\n",
                   "incident.json")
    except Exception:
        log.exception("could not write %s", Path(output_dir) / INCIDENT_FILE)
    return event


def last_words_dir(output_dir: Path) -> Path:
    return Path(output_dir) / LAST_WORDS_DIR / f"attempt-{attempt_tag()}"


def write_last_words(output_dir: Path, rank: int) -> None:
    """This rank's Python stacks (every thread: the main one shows where it waits) and, on NCCL, the flight
    recorder's record of its collectives; for a rank the job is ending."""
    import faulthandler

    directory = last_words_dir(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"rank{rank}.stacks.txt", "w") as handle:
        faulthandler.dump_traceback(file=handle, all_threads=True)
    trace = nccl_flight_record()
    if trace is not None:
        (directory / f"rank{rank}.nccl_trace.pkl").write_bytes(trace)
    record = flight_record()
    if record is not None:  # whole or not at all: the reporting rank waits for these files to appear
        temporary = directory / f".{FR_DUMP_PREFIX}{rank}.tmp"
        temporary.write_bytes(record)
        os.replace(temporary, directory / f"{FR_DUMP_PREFIX}{rank}")


def flight_recorder_state() -> str | None:
    """None where torch's flight recorder records this process's collectives, else why not (one line)."""
    size = os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0"))
    if not size.isdigit() or int(size) == 0:
        return "torch's flight recorder was off (TORCH_FR_BUFFER_SIZE unset or 0): no record of the collectives"
    return None


def flight_record() -> bytes | None:
    """This process's flight recorder dump in the form torch's analyser reads: NCCL's own recorder on NCCL (untested
    here: no GPU), the backend-neutral one gloo records into otherwise; None when it is off."""
    try:
        import torch.distributed as dist

        if flight_recorder_state() is not None or not dist.is_initialized():
            return None
        if dist.get_backend() == "nccl":
            return nccl_flight_record()
        return flight_recorder_dump()
    except Exception as exc:  # a torch without the backend-neutral recorder: the stacks still say where each rank was
        log.warning("no flight recorder dump: %s", exc)
        return None


def analyse_collectives(output_dir: Path, world: int, expected: int | None = None, wait_s: float = FR_WAIT_S) -> dict:
    """The `collectives` event of a hang: torch's flight recorder analyser (python -m
    torch.distributed.flight_recorder.fr_trace) over the dumps in this attempt's last words, once `expected` ranks'
    (default: every rank's) are there or `wait_s` has passed (a frozen rank writes none: the analysis then covers the
    ranks that did, and torch's analyser says what it cannot decide without the others).

    torch's analyser unpickles the dumps, so it reads only those this job's ranks wrote: files older than this
    process (a reused or copied output directory keeps an earlier job's attempt-<tag> folders) are counted in
    `stale_dumps` and never opened."""
    import re
    import shutil
    import tempfile
    import time

    off = flight_recorder_state()
    if off is not None:
        return {"event": "collectives", "recorder": off, "dumps": [], "collective": None, "missing_ranks": None,
                "analysis": []}
    directory = last_words_dir(output_dir)
    since = _process_started()
    deadline = time.monotonic() + wait_s
    while True:
        fresh, stale = _dumps(directory, since)
        if len(fresh) >= (world if expected is None else expected) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    dumps = sorted(fresh)
    event = {"event": "collectives", "recorder": "on", "dumps": dumps, "collective": None, "missing_ranks": None,
             "analysis": [], "stale_dumps": stale}
    if not dumps:
        event["recorder"] = "on, but no rank's dump arrived"
        return event
    with tempfile.TemporaryDirectory(prefix=".fr-", dir=directory) as analysed:
        for rank, path in fresh.items():  # this job's dumps alone, in a folder of their own
            shutil.copyfile(path, Path(analysed) / path.name)
        lines = _torch_analysis([analysed, "--prefix", FR_DUMP_PREFIX,
                                 *(["--allow-incomplete-ranks"] if len(dumps) < world else [])])
    event["analysis"] = lines[:60]
    for line in lines:
        if (match := re.match(r"\s*collective: (\S+)", line)) and event["collective"] is None:
            event["collective"] = match.group(1)
        if (match := re.match(r"\s*missing ranks: \{([\d, ]*)\}", line)) and event["missing_ranks"] is None:
            event["missing_ranks"] = [int(r) for r in match.group(1).split(",") if r.strip()]
    return event


def _process_started() -> float:
    """When this process started (epoch seconds): every dump of its job's attempt is written after it."""
    import psutil

    return psutil.Process().create_time()


def _dumps(directory: Path, since: float) -> tuple[dict[int, Path], int]:
    """{rank: dump path} of the flight recorder dumps written at or after `since`, and how many older ones lie there."""
    fresh, stale = {}, 0
    for path in directory.glob(f"{FR_DUMP_PREFIX}*"):
        rank = path.name[len(FR_DUMP_PREFIX):]
        if not rank.isdigit() or not path.is_file() or path.is_symlink():
            continue
        if path.stat().st_mtime >= since:
            fresh[int(rank)] = path
        else:
            stale += 1
    return fresh, stale


def _torch_analysis(args: list[str]) -> list[str]:
    """torch's analyser (torch.distributed.flight_recorder.fr_trace, its command line's main) run in this process,
    its report read from the logger it writes to: a child process would be ended with this rank by the launcher's
    SIGTERM to the job."""
    import logging

    from torch.distributed.flight_recorder import fr_trace

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.extend(self.format(record).splitlines())

    logger, handler = logging.getLogger("Flight Recorder"), Collect()
    logger.addHandler(handler)
    try:
        fr_trace.main(args)
    except BaseException as exc:  # SystemExit included: the analysis is a report, never the reason a rank stops
        lines.append(f"torch's analyser stopped: {type(exc).__name__}: {exc}")
    finally:
        logger.removeHandler(handler)
        import gc

        gc.enable()  # its loader turns the collector off for the reading
    return [line for line in lines if line.strip()]


def nccl_flight_record() -> bytes | None:
    """torch's NCCL flight recorder dump (a pickle: the last collectives, their state and stacks), as NCCL's own
    timeout would write it; None without NCCL or with the recorder off (TORCH_NCCL_TRACE_BUFFER_SIZE=0)."""
    try:
        import torch
        import torch.distributed as dist

        if not (torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"):
            return None
        return nccl_trace_dump()
    except Exception as exc:  # an older torch or a build without NCCL: the stacks still say where each rank was
        log.debug("no NCCL flight record: %s", exc)
        return None


def flight_recorder_environment(output_dir: Path) -> dict[str, str]:
    """torch's NCCL flight recorder, on unless the launcher's environment says otherwise: a ring of the last
    collectives per rank (TORCH_NCCL_TRACE_BUFFER_SIZE), dumped when NCCL's own watchdog times out
    (TORCH_NCCL_DUMP_ON_TIMEOUT) into OUTPUT/incident/ (TORCH_FR_DUMP_TEMP_FILE, a file name prefix). Read when the
    NCCL process group is created, so set before it; gloo ignores them."""
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": FR_BUFFER, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(last_words_dir(output_dir) / "nccl_timeout_trace_rank_")}


def gloo_flight_recorder_environment() -> dict[str, str]:
    """torch's backend-neutral flight recorder (torch 2.13 records gloo's collectives into it when
    TORCH_FR_BUFFER_SIZE is set), on unless the launcher's environment says otherwise; read when the process group is
    created."""
    return {"TORCH_FR_BUFFER_SIZE": FR_BUFFER}
