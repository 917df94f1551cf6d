"""Run the health check: one rank under any launcher (store, watchdog, checks, report), or N local ranks (--nproc)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

from toolkit.errors import worker_error
from toolkit.estimate.device_peak import matmul_benchmark
from toolkit.health import checks, collectives
from toolkit.health.collectives import tier_bandwidths
from toolkit.health.options import HealthOptions
from toolkit.health.verdict import HealthReport, add_deaths, incomplete, judge
from toolkit.runtime.children import Children
from toolkit.runtime.job import STORE_HOSTED_ENV, RankEnv, connect_store
from toolkit.runtime.watchdog import (
    LivenessTracker,
    Watchdog,
    exit_now,
    find_unresponsive,
    raise_terminated,
    read_beats,
    read_hosts,
)

log = logging.getLogger(__name__)
STORE_PREFIX = "dmt-health"
OPTIONS_ENV = "DMT_HEALTH_OPTIONS"  # spawned ranks get their options as JSON here
REPORT_KEY = "report"  # ... and hand the report back under this store key
GRACE_S = 3.0  # after a hang or failure report: time for the ranks to exit by themselves before they are killed
# after a healthy report: the ranks still pass a barrier, stop their watchdog threads, destroy the process group and
# exit the interpreter, which took over 3 s at load ~20 on 2 cores (a healthy run then exited 1, its ranks killed);
# the wait ends as soon as they have exited
HEALTHY_EXIT_S = 60.0
# A rank not started this long after the first one never started. Its interpreter and torch import come before its
# first heartbeat and are no part of the check the deadline bounds: they took 22 s at load ~17 on 2 cores, the second
# rank 1.5 s after the first (a healthy start with --deadline-s 4 was then reported as 'never started'). The ranks wait
# for each other (at most this long) before their monitors start; `--nproc N` waits as long for every rank's first beat.
START_S = 120.0
Emit = Callable[[dict, object], None]  # (the report as JSON, a store client the calling thread may use)


def run_rank(options: HealthOptions, env: RankEnv, emit: Emit) -> int:
    """Run every check on this rank; the reporting rank calls `emit`. Returns the job's verdict (0 healthy, 1 not)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", _device_index(env.local_rank, torch.cuda.device_count())) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(checks.cpu_threads_per_rank(env.local_world_size))
    hosts_store = env.rank == 0 and not env.agent_store
    job_store = connect_store(env, max(300.0, options.deadline_s), master=hosts_store)
    side_timeout = max(2.0, min(options.deadline_s / 2, 30.0))  # threads never block longer than this on the store
    factory = lambda: PrefixStore(STORE_PREFIX, connect_store(env, side_timeout, master=False))  # noqa: E731
    partial: dict = {}

    def report_hang(unresponsive: list[dict], store) -> None:
        try:
            hosts = watchdog.hosts(store)
        except Exception:  # the store itself is what stopped answering
            hosts = [env.host if r == env.rank else None for r in range(env.world_size)]
        for entry in unresponsive:
            entry["host"] = entry["host"] or hosts[entry["rank"]]
        report = incomplete(env.world_size, hosts, "hang", unresponsive, [], [], _snapshot(partial))
        emit(report.model_copy(update={"reported_by": env.rank}).as_json(), store)

    _await_every_rank(job_store, env.world_size)
    watchdog = Watchdog(factory, env.rank, env.world_size, env.host, options.deadline_s, options.heartbeat_s,
                        report_hang, store_host_rank=None if env.agent_store else 0)
    watchdog.start()
    if options.pid_dir:  # written once the heartbeat runs: whoever reads it may stop or kill a rank that is being watched
        _write_whole(Path(options.pid_dir, f"rank{env.rank}.pid"), str(os.getpid()))

    def step(name: str, uniform: bool = True) -> None:
        """Enter the next step: the heartbeat names it, and so does rank<N>.step in --pid-dir (whoever stops or kills
        a rank there knows where it is)."""
        watchdog.step(name, uniform)
        if options.pid_dir:
            _write_whole(Path(options.pid_dir, f"rank{env.rank}.step"), name)

    previous_term = signal.signal(signal.SIGTERM, raise_terminated)
    sizes, iters = options.sizes_for(cuda), options.iters_for(cuda)
    try:
        step("init_process_group")
        dist.init_process_group("nccl" if cuda else "gloo", store=PrefixStore("pg", job_store), rank=env.rank,
                                world_size=env.world_size)  # the default timeout: the watchdog, not it, names hangs
        step("host facts and memory")
        facts = checks.host_facts(env.host, device) | {"local_world_size": env.local_world_size}
        facts["memory_check"] = checks.memory_check(device, options.mem_fraction)
        step("matmul benchmark")
        facts.update(matmul_benchmark(device, options.matmul_seconds))
        bandwidth: dict = {"intra_node_busbw_gbps": None, "inter_node_busbw_gbps": None, "size_bytes": max(sizes),
                           "per_host_intra_node_busbw_gbps": {}}
        links: list[dict] = []
        if env.world_size > 1:
            collectives.sweep(sizes, iters, env.world_size, env.rank, device, step, partial)
            step("hosts")
            hosts: list = [None] * env.world_size
            dist.all_gather_object(hosts, env.host)
            links = collectives.measure_links(env.world_size, env.rank, device, max(sizes), iters, step)
            bandwidth.update(_bandwidth(partial, hosts, env.rank, device, max(sizes), iters, step))
        step("gather facts")
        watchdog.store.set(f"facts/{env.rank}", json.dumps(facts))
        dist.barrier()
        if env.rank == 0:
            per_rank = [json.loads(watchdog.store.get(f"facts/{r}")) for r in range(env.world_size)]
            report = judge(per_rank, partial, bandwidth, links, options).model_copy(update={"reported_by": 0})
            if watchdog.claim_report():  # a monitor may have claimed it first (a hang at the last moment)
                emit(report.as_json(), watchdog.store)
            watchdog.store.set("verdict", "0" if report.ok else "1")
        step("final barrier")
        dist.barrier()
        verdict = int(watchdog.store.get("verdict"))
    except Exception as exc:  # a peer died, the launcher is ending the job, or a collective failed
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish the report; the launcher kills us later if it must
        _fail(exc, watchdog, env, options, emit, partial)
    signal.signal(signal.SIGTERM, previous_term)
    watchdog.finish()
    dist.destroy_process_group()
    return verdict


def _await_every_rank(store, world: int) -> None:
    """Until every rank has come this far, or START_S has passed (then the monitors name the ranks missing)."""
    key = f"{STORE_PREFIX}/started"
    arrived, deadline = store.add(key, 1), time.monotonic() + START_S
    while arrived < world and time.monotonic() < deadline:
        time.sleep(0.05)
        arrived = store.add(key, 0)


def _write_whole(path: Path, text: str) -> None:
    """Replace `path` at once: a reader sees the old text or the new, never an empty or half-written file."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(text)
    os.replace(partial, path)


def _device_index(local_rank: int, visible: int) -> int:
    """LOCAL_RANK's GPU; with one GPU per rank (srun --gpus-per-task=1) the only one. Too few GPUs show in the
    report (visible_devices vs the ranks per node), so the check still runs and says so."""
    return local_rank if local_rank < visible else local_rank % visible


def _bandwidth(results: dict, hosts: list[str], rank: int, device, size: int, iters: int, progress) -> dict:
    """Per-tier all_reduce busbw at the largest size: the sweep already measured it when there is one node."""
    if len(set(hosts)) == 1:
        busbw = results["all_reduce"][str(size)]["busbw_gbps"]
        return {"intra_node_busbw_gbps": busbw, "per_host_intra_node_busbw_gbps": {hosts[0]: busbw}}
    tiers = tier_bandwidths(hosts, rank, device, size, iters, progress)
    return {"intra_node_busbw_gbps": min(tiers["intra_node"].values()) if tiers["intra_node"] else None,
            "inter_node_busbw_gbps": tiers["inter_node"], "per_host_intra_node_busbw_gbps": tiers["intra_node"]}


def _snapshot(results: dict) -> dict:
    """A copy of the collectives measured so far; the main thread may be adding one while a monitor reads."""
    for _ in range(3):
        try:
            return json.loads(json.dumps(results))
        except RuntimeError:  # changed size during iteration
            time.sleep(0.01)
    return {}


def _fail(exc: BaseException, watchdog, env: RankEnv, options: HealthOptions, emit: Emit, partial: dict) -> None:
    """Name who is gone (connection lost and no heartbeat), report once for the job, and exit non-zero now:
    destroying a process group with a dead peer can block."""
    if watchdog.tripped.is_set():  # the monitor is already reporting a hang and will end this process
        time.sleep(options.deadline_s + 30)
    elif watchdog.claim_report():
        silent = watchdog.silent_ranks(max(1.5, 6 * options.heartbeat_s))
        hosts = watchdog.hosts()
        died = [{"rank": r, "host": hosts[r], "how": "connection lost and no heartbeat (killed, crashed or stopped)"}
                for r in silent]
        reason = f"rank {env.rank} ({env.host}) in step '{watchdog.step_name}': {type(exc).__name__}: " \
                 f"{(str(exc).splitlines() or [''])[0][:200]}"
        report = incomplete(env.world_size, hosts, "failure", [], died, [reason], _snapshot(partial))
        emit(report.model_copy(update={"reported_by": env.rank}).as_json(), watchdog.store)
        watchdog.report_written()
    else:
        watchdog.wait_for_report()
    watchdog.mark_exit()
    log.debug("rank %d ends after: %s", env.rank, exc)
    exit_now(1)


# ---- `dmt health --nproc N` ------------------------------------------------------------------------------------


def spawn_local(nproc: int, options: HealthOptions) -> tuple[dict, int]:
    """Run the check on `nproc` local ranks; (report as JSON, exit code). Ranks that die are reported, never waited on.

    This process hosts the TCPStore (not rank 0), so any rank, rank 0 included, can be stopped or die and the others
    still report; it sees every exit and its signal; and its own reading of the heartbeats is the last resort when
    no rank is left to report.
    """
    from torch.distributed import PrefixStore, TCPStore

    server = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    store = PrefixStore(STORE_PREFIX, server)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), **{STORE_HOSTED_ENV: "1", OPTIONS_ENV: json.dumps(asdict(options))})
    stderr = [tempfile.TemporaryFile() for _ in range(nproc)]  # each rank's; its one-line error becomes ours
    exits: dict[int, int] = {}  # rank -> exit code
    try:
        # SIGKILL at the end (no grace): it also ends a stopped rank, and a rank still running then is stuck
        with Children(f"the {nproc} health-check rank{'s' if nproc > 1 else ''}", grace_s=0) as children:
            procs = [children.start([sys.executable, "-m", "toolkit.health.worker"], stdout=subprocess.DEVNULL,
                                    stderr=stderr[r], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
                     for r in range(nproc)]
            beats, report, hosts, own_hang = _watch(procs, store, options, exits)
    except KeyboardInterrupt:
        for handle in stderr:
            handle.close()
        raise
    except BaseException:
        _replay_worker_errors(stderr, exits)
        raise
    _replay_worker_errors(stderr, exits)
    done = {rank for rank, beat in beats.items() if beat.finished}
    died = [{"rank": rank, "host": hosts[rank], "how": _how(code)} for rank, code in sorted(exits.items())
            if code != 0 and rank not in done]
    if report is None:
        report = incomplete(nproc, hosts, "hang" if own_hang else "failure", own_hang, [],
                            [] if own_hang or died else ["no rank produced a report"])
    if died:
        report = add_deaths(report, died)
    healthy = report.ok and all(code == 0 or rank in done for rank, code in exits.items())
    return report.as_json(), 0 if healthy and len(exits) == nproc else 1


def _watch(procs: list, store, options: HealthOptions, exits: dict[int, int]):
    """Until every rank has exited, or a report is in and the ranks that can exit have, or nobody reports a rank's
    death or a hang the ranks' monitors cannot see: (beats, the ranks' report or None, hosts, this process's own
    reading of a hang). `exits` fills with each rank's exit code as it is seen."""
    nproc = len(procs)
    started = time.monotonic()
    tracker = None  # judged once every rank has started (or START_S has passed)
    # the ranks' own monitors report first; this one only when none of them could (every monitor rank stopped)
    backstop_s = options.deadline_s * 1.5 + 5
    reported_at = first_death = None
    grace_s = GRACE_S
    stuck: set[int] = set()
    own_hang: list[dict] = []
    hosts: list[str | None] = [None] * nproc
    while True:
        now = time.monotonic()
        for rank, proc in enumerate(procs):
            if rank not in exits and proc.poll() is not None:
                exits[rank] = proc.returncode
                if proc.returncode != 0 and first_death is None:
                    first_death = now
        if reported_at is None and store.check([REPORT_KEY]):
            reported_at = now
            written = HealthReport.model_validate_json(store.get(REPORT_KEY))
            stuck = {u.rank for u in written.unresponsive}
            grace_s = HEALTHY_EXIT_S if written.ok else GRACE_S
        if len(exits) == nproc or (reported_at is not None and now - reported_at > grace_s):
            break
        if reported_at is not None and set(range(nproc)) <= set(exits) | stuck:
            break  # everyone who can exit has; the unresponsive ones will not
        if reported_at is None and first_death is not None and now - first_death > min(options.deadline_s, 10) + 5:
            break  # a rank died and nobody reported it: the ranks left are stuck somewhere
        if reported_at is None:
            hosts = read_hosts(store, nproc) if None in hosts else hosts
            beats = read_beats(store, nproc)
            if tracker is None and (len(beats) == nproc or now - started > START_S):
                # from now on, from the start for a rank never heard from
                tracker = LivenessTracker(nproc, now if len(beats) == nproc else started)
            if tracker is not None:
                own_hang = find_unresponsive(tracker.observe(beats, hosts, now), backstop_s)
            if own_hang:
                break
        time.sleep(0.1)
    beats = read_beats(store, nproc)
    report = HealthReport.model_validate_json(store.get(REPORT_KEY)) if store.check([REPORT_KEY]) else None
    hosts = read_hosts(store, nproc)
    return beats, report, hosts, own_hang


def _replay_worker_errors(stderr: list, exits: dict[int, int]) -> None:
    """What the ranks wrote to stderr goes to ours; a rank that refused bad input (exit code 2) makes this command
    refuse it too, with that rank's one line."""
    texts = []
    for handle in stderr:
        handle.seek(0)
        texts.append(handle.read().decode(errors="replace"))
        handle.close()
    for rank, code in sorted(exits.items()):
        if code == 2 and (error := worker_error(texts[rank], f"rank {rank}")) is not None:
            raise error
    sys.stderr.write("".join(texts))


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
