"""Run the health check on every rank (under torchrun/srun/deepspeed/accelerate, or as ranks spawned by --nproc)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class HealthOptions:
    sizes: tuple[int, ...] = (1 << 10, 1 << 16, 1 << 20, 1 << 24)
    deadline_s: float = 30.0
    straggler_factor: float = 2.0
    min_busbw_gbps: float | None = None
    matmul_seconds: float = 1.0
    mem_fraction: float = 0.5
    expected_devices: int | None = None
    gpu: str | None = None
    pid_dir: str | None = None
    report_path: str | None = None


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def host_facts(device) -> dict:
    import torch

    facts = {"host": socket.gethostname(), "pid": os.getpid(), "device": str(device),
             "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
             "numa_nodes": len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))),
             "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL_"))}}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(gpu_name=props.name, gpu_uuid=str(getattr(props, "uuid", "")), visible_devices=torch.cuda.device_count(),
                     memory_bytes=props.total_memory)
    return facts


def _memory_check(device, fraction: float) -> str | None:
    """Allocate and touch `fraction` of free device memory; None when it works."""
    import torch

    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    try:
        block = torch.empty(int(free * fraction) // 4, dtype=torch.float32, device=device)
        block.fill_(1.0)
        del block
        torch.cuda.empty_cache()
    except RuntimeError as exc:
        return f"allocating {fraction:.0%} of free memory failed: {str(exc).splitlines()[0]}"
    return None


def run_rank(options: HealthOptions) -> int:
    """One rank's whole check; the reporting rank writes the report. Exit code 0 only when healthy."""
    import torch
    import torch.distributed as dist

    from toolkit.health import collectives
    from toolkit.health.report import judge
    from toolkit.health.watchdog import Watchdog

    rank, world, local = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if options.pid_dir:
        Path(options.pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store_port = _env_int("DMT_HEALTH_STORE_PORT", _env_int("MASTER_PORT", 29500) + 1)

    def report_hang(silent: list[dict]) -> None:
        problems = [f"rank {s['rank']} unresponsive for {s['silent_s']} s (last phase: {s['last_phase']})" for s in silent]
        _emit(options, {"ok": False, "world_size": world, "unresponsive": silent, "problems": problems,
                        "phase": "hang", "reported_by": rank})

    watchdog = Watchdog(master, store_port, rank, world, options.deadline_s, report_hang)
    watchdog.start()
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    facts = host_facts(device)
    facts["memory_problem"] = _memory_check(device, options.mem_fraction)
    watchdog.set_phase("matmul")
    facts["matmul_gflops"] = collectives.matmul_gflops(device, options.matmul_seconds)
    try:
        results = collectives.sweep(list(options.sizes), world, rank, device, watchdog.set_phase)
        links = collectives.ring_links(world, rank, device, max(options.sizes), watchdog.set_phase) if world > 1 else []
        intra, inter = _tier_bandwidths(results, facts["host"], world, rank, device, max(options.sizes), watchdog)
    except RuntimeError as exc:  # a peer died: gloo/nccl raise; the watchdog names who stopped beating
        watchdog.set_phase(f"failed: {str(exc).splitlines()[0][:120]}")
        time.sleep(options.deadline_s + 5)
        os._exit(4)
    watchdog.set_phase("report")
    watchdog.store.set(f"facts/{rank}", json.dumps(facts))
    dist.barrier()
    if rank == 0:
        per_rank = [json.loads(watchdog.store.get(f"facts/{r}")) for r in range(world)]
        report = judge(per_rank, results, links, intra, inter, options)
        _emit(options, report)
        code = 0 if report["ok"] else 1
    else:
        code = 0
    watchdog.set_phase("done")
    dist.barrier()
    watchdog.stop()
    dist.destroy_process_group()
    return code


def _tier_bandwidths(results, host, world, rank, device, size, watchdog) -> tuple[float | None, float | None]:
    """all_reduce busbw inside one node and across nodes (one rank per node); None when not measurable."""
    import torch.distributed as dist

    from toolkit.health.collectives import _run_op, bandwidths

    hosts = [None] * world
    dist.all_gather_object(hosts, host)
    names = sorted(set(hosts))
    largest = results["all_reduce"][str(size)]["busbw_gbps"]
    if len(names) == 1:
        return (largest if world > 1 else None), None
    watchdog.set_phase("tiers")
    node_groups = [dist.new_group([r for r in range(world) if hosts[r] == name]) for name in names]
    leaders = [hosts.index(name) for name in names]
    cross = dist.new_group(leaders)
    mine = node_groups[names.index(host)]
    local_size = hosts.count(host)
    seconds, _ = _run_op("all_reduce", size, local_size, rank, device, group=mine) if local_size > 1 else (0, True)
    intra = bandwidths("all_reduce", size, seconds, local_size)[1] if local_size > 1 else None
    inter = None
    if rank in leaders:
        seconds, _ = _run_op("all_reduce", size, len(names), leaders.index(rank), device, group=cross)
        inter = bandwidths("all_reduce", size, seconds, len(names))[1]
    return intra, inter


def _emit(options: HealthOptions, report: dict) -> None:
    text = json.dumps(report, indent=2)
    if options.report_path:
        tmp = Path(options.report_path + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, options.report_path)
    else:
        print(text, flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_local(nproc: int, options: HealthOptions, timeout_s: float | None = None) -> tuple[dict, int]:
    """Start `nproc` ranks on this machine, watch them, and return (report, exit code); dead ranks are reported."""
    import tempfile

    workdir = Path(tempfile.mkdtemp(prefix="dmt-health-"))
    report_path = workdir / "report.json"
    opts = asdict(options) | {"report_path": str(report_path)}
    port = _free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
               DMT_HEALTH_STORE_PORT=str(_free_port()), DMT_HEALTH_OPTIONS=json.dumps(opts))
    procs = [subprocess.Popen([sys.executable, "-m", "toolkit.health.worker"],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nproc)),
                              start_new_session=True) for r in range(nproc)]
    limit = time.monotonic() + (timeout_s or options.deadline_s * 3 + 120)
    died: list[dict] = []
    reported_at = None
    while time.monotonic() < limit and any(p.poll() is None for p in procs):
        for rank, proc in enumerate(procs):
            code = proc.poll()
            if code is not None and code < 0 and all(d["rank"] != rank for d in died):
                died.append({"rank": rank, "signal": signal.Signals(-code).name})
        if report_path.is_file() and reported_at is None:
            reported_at = time.monotonic()
        if reported_at is not None and time.monotonic() - reported_at > 5:
            break  # the verdict is in; ranks still running are stopped or stuck: do not wait for them
        time.sleep(0.1)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    report = json.loads(report_path.read_text()) if report_path.is_file() else {
        "ok": False, "world_size": nproc, "problems": ["no rank produced a report"]}
    if died:
        report["ok"] = False
        report["died"] = died
        report.setdefault("problems", []).extend(f"rank {d['rank']} died ({d['signal']})" for d in died)
    codes = [p.returncode for p in procs]
    report.setdefault("died", [])
    return report, 0 if report.get("ok") and all(c == 0 for c in codes) else 1
