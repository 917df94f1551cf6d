"""`training.restart: in_process`: the training function runs inside NVIDIA Resiliency Extension's in-process restart
(nvidia_resiliency_ext.inprocess.Wrapper, NVRx 0.4.1). A rank that dies (SIGKILL, out of memory) or stops making
progress is left out; the function restarts in the surviving processes, a hot spare (training.spare_ranks) taking
the lost rank's place, and training continues from the latest verified checkpoint. Healthy ranks keep their process:
no interpreter start, no imports, no relaunch.

What NVRx does here: the rank monitor (a process per rank watching its heartbeat; SIGKILL or silence for
`hang_timeout_s` marks it terminated), the restart barrier across ranks, the new rank assignment (ShiftRanks over
MaxActiveWorldSize: the spares fill gaps), its own TCPStore at MASTER_PORT. What the toolkit does: the process group
of each restart iteration (gloo or nccl, on a PrefixStore per iteration over a store at MASTER_PORT + 1), the abort
(destroying the groups: NVRx's AbortTorchDistributed asks a CUDA backend of each group, which a gloo group does not
have), the resume from `latest`, the records (incident.json's failure, restart and resumed events, the last with the
time from the failure to the end of the next step), and ending for good on what a restart cannot fix (bad input, the
guard's stop, training.max_restarts restarts).

Limits (NVRx's own, and said in docs/faults.md): the store host (initial rank 0) cannot be lost; a rank's process
is not started again, so the job survives as many losses as it has spares.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from toolkit.errors import UserInputError
from toolkit.runtime.guard import GuardStop
from toolkit.runtime.incident import RESTART_COUNTERS, append_incident

log = logging.getLogger(__name__)
ITERATION_ENV = RESTART_COUNTERS["in_process"]  # the restart iteration: a restart to incident.json and fault injection
SPARES_ENV = "DMT_SPARE_RANKS"  # set by launch.sh: how many of WORLD_SIZE processes wait as hot spares
STORE_PORT_OFFSET = 1  # the process groups' store: MASTER_PORT + 1 (NVRx's own store is at MASTER_PORT)
_failed_at: float | None = None  # when this rank saw the failure that the current restart iteration follows
_call_wrapper = None  # NVRx's CallWrapper of the iteration running on this rank (ping())


class Final(BaseException):
    """What a restart cannot fix (bad input, the guard's stop, out of restarts): NVRx ends a rank whose function
    raises a BaseException instead of restarting it; run() raises the original again."""

    def __init__(self, original: BaseException):
        super().__init__(str(original))
        self.original = original


def iteration() -> int:
    value = os.environ.get(ITERATION_ENV, "")
    return int(value) if value.isdigit() else 0


def timeouts(hang_timeout_s: float) -> dict:
    """The Wrapper's timeouts from training.hang_timeout_s (NVRx checks soft < hard < barrier, heartbeat < barrier):
    a rank without progress for hang_timeout_s is aborted (soft), and terminated half as long again later (hard);
    hang_timeout_s 0 (no watchdog) leaves an hour."""
    soft = max(hang_timeout_s, 10.0) if hang_timeout_s > 0 else 3600.0
    return dict(soft_timeout=timedelta(seconds=soft), hard_timeout=timedelta(seconds=soft * 1.5),
                heartbeat_timeout=timedelta(seconds=min(soft, 30.0)),
                barrier_timeout=timedelta(seconds=soft * 2 + 60), completion_timeout=timedelta(seconds=soft * 2 + 60))


def run(train: Callable[[bool], dict], output_dir: Path, gpus: int, max_restarts: int, hang_timeout_s: float,
        backend: str) -> dict | None:
    """train(resume) under NVRx's in-process restart on each of WORLD_SIZE processes (gpus active, the rest spares):
    `resume` is True from the first restart on. Returns train's summary on active ranks, None on a spare that was
    never needed."""
    import torch.distributed as dist
    from nvidia_resiliency_ext import inprocess  # lazy: nvidia_resiliency_ext
    from nvidia_resiliency_ext.inprocess import rank_assignment

    output_dir = Path(output_dir)
    base_store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                               int(os.environ.get("MASTER_PORT", "29500")) + STORE_PORT_OFFSET, None,
                               int(os.environ.get("RANK", "0")) == 0, timedelta(seconds=300), wait_for_workers=False,
                               multi_tenant=True)

    class AbortGroups(inprocess.abort.Abort):
        """Unblock this rank and drop its process groups (every backend: gloo has no abort of its own, and a gloo
        collective whose peer died has already raised)."""

        def __call__(self, state):
            global _failed_at
            _failed_at = _failed_at or time.time()
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # a group whose peer is gone may refuse a clean end; the next iteration makes new ones
                    log.exception("in-process restart: destroying the process groups")
            return state

    class RecordFailure(inprocess.finalize.Finalize):
        """Rank 0 names the failure in incident.json: NVRx's interruption (which ranks, terminated or timed out), the
        exception being handled while this runs in the main thread; the function's own exception besides."""

        def __call__(self, state):
            if state.rank == 0:
                interruption = sys.exc_info()[1]
                append_incident(output_dir, {"event": "failure", "restart": "in_process", "iteration": state.iteration,
                                             "reason": str(interruption or state.fn_exception)[:300],
                                             "raised": repr(state.fn_exception)[:300], "reported_by": 0,
                                             "pid": os.getpid()})
            return state

    limits = timeouts(hang_timeout_s)
    wrapper = inprocess.Wrapper(
        abort=AbortGroups(), finalize=RecordFailure(),
        rank_assignment=inprocess.Compose(rank_assignment.MaxActiveWorldSize(gpus), rank_assignment.ShiftRanks()),
        **limits)

    def restartable(call_wrapper=None):
        global _failed_at, _call_wrapper
        _call_wrapper, it = call_wrapper, call_wrapper.iteration
        os.environ[ITERATION_ENV] = str(it)
        if it > max_restarts:
            raise Final(UserInputError("training.max_restarts", f"{max_restarts} in-process restarts used up"))
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        log.info("in-process restart iteration %d: rank %d of %d (pid %d)", it, rank, world, os.getpid())
        if backend == "nccl":
            import torch

            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # a spare keeps its own device
        # the default group's collectives give up at the soft timeout (gloo has no abort that frees a thread blocked
        # in one); Megatron-Core's own groups keep their distributed_timeout_minutes, so a rank waiting there for a
        # hung peer is ended by NVRx's hard timeout: a hang is not recovered in-process on gloo (docs/faults.md)
        dist.init_process_group(backend, store=dist.PrefixStore(f"dmt-iteration-{it}", base_store), rank=rank,
                                world_size=world, timeout=limits["soft_timeout"])
        try:
            return train(it > 0)
        except (UserInputError, GuardStop) as exc:
            raise Final(exc) from exc
        except Exception:
            _failed_at = _failed_at or time.time()
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    # NVRx hands its CallWrapper to the parameter annotated with the class (a real one: this module's annotations
    # are strings)
    restartable.__annotations__ = {"call_wrapper": inprocess.CallWrapper}
    try:
        return wrapper(restartable)()
    except Final as final:
        raise final.original from None


def ping() -> None:
    """This rank made progress (every phase of a step, TrainingWatchdog.phase): from the first ping of a restart
    iteration NVRx's soft and hard timeouts count from the last one, so a rank stuck in a step for hang_timeout_s is
    restarted, however alive its threads are (without pings NVRx counts its own thread's, which a rank asleep in
    Python or blocked in a collective keeps sending)."""
    if _call_wrapper is not None:
        _call_wrapper.ping()


def record_resumed(output_dir: Path, step: int) -> None:
    """After an in-process restart, once, on rank 0: incident.json's `resumed` event for the first step trained since
    the failure, with the restart's own time (`restart_s`: from the moment this rank saw the failure to the end of
    that step) and this process's pid (the same as before the failure: nothing was relaunched)."""
    global _failed_at
    if _failed_at is None or iteration() == 0:
        return
    if int(os.environ.get("RANK", "0")) == 0:
        append_incident(output_dir, {"event": "resumed", "restart": "in_process", "iteration": iteration(),
                                     "step": step, "pid": os.getpid(), "restart_s": round(time.time() - _failed_at, 3)})
    _failed_at = None


def spares() -> int:
    value = os.environ.get(SPARES_ENV, "")
    return int(value) if value.isdigit() else 0
