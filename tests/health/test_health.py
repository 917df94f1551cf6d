"""`dmt health` with real gloo ranks: a healthy run, a stopped rank, a slowed rank, a dead rank."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import free_port
from toolkit.estimate.comm import BUS_FACTOR
from toolkit.health.collectives import bandwidths

pytestmark = pytest.mark.distributed
DMT = [sys.executable, "-m", "toolkit"]


def test_bus_bandwidth_follows_nccl_tests():
    assert bandwidths("all_reduce", 8e9, 1.0, 8) == pytest.approx((8.0, 8.0 * 2 * 7 / 8))
    assert bandwidths("all_gather", 8e9, 2.0, 4) == pytest.approx((4.0, 3.0))
    assert bandwidths("broadcast", 1e9, 1.0, 16)[1] == pytest.approx(1.0)
    assert BUS_FACTOR["reduce_scatter"](2) == 0.5


def _health(*flags, timeout=180):
    return subprocess.run([*DMT, "health", "--json", *flags], capture_output=True, text=True, timeout=timeout)


def test_two_local_ranks_are_healthy():
    result = _health("--nproc", "2", "--sizes", "1K,1M,4M", "--matmul-seconds", "0.5")
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["ok"] and report["world_size"] == 2, report["problems"]
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        rows = report["collectives"][op]
        assert all(row["correct"] for row in rows.values())
        assert rows[str(4 << 20)]["busbw_gbps"] > rows["1024"]["busbw_gbps"] > 0  # bigger messages move faster
    assert report["bandwidth"]["intra_node_busbw_gbps"] > 0 and report["bandwidth"]["inter_node_busbw_gbps"] is None
    assert len(report["links"]) == 2 and all(r["matmul_gflops"] > 0 for r in report["ranks"])


def test_under_torchrun():
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "toolkit", "health", "--sizes", "1K,1M", "--matmul-seconds", "0.3"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                            env=dict(os.environ, DMT_HEALTH_STORE_PORT=str(free_port())))
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert result.returncode == 0 and report["ok"] and report["world_size"] == 2


def _start(tmp_path, *flags):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    process = subprocess.Popen([*DMT, "health", "--json", "--nproc", "2", "--pid-dir", str(pid_dir), *flags],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 60
    while len(list(pid_dir.glob("*.pid"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return process, {r: int((pid_dir / f"rank{r}.pid").read_text()) for r in (0, 1)}


def test_a_stopped_rank_is_named_unresponsive_within_the_deadline(tmp_path):
    process, pids = _start(tmp_path, "--deadline-s", "4", "--matmul-seconds", "2")
    os.kill(pids[1], signal.SIGSTOP)
    started = time.monotonic()
    try:
        out, _ = process.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the spawner ends stopped ranks itself
            os.kill(pids[1], signal.SIGKILL)
    report = json.loads(out)
    assert process.returncode != 0 and not report["ok"]
    assert [u["rank"] for u in report["unresponsive"]] == [1]
    assert time.monotonic() - started < 4 + 15  # named soon after the deadline, not hung on


def test_a_rank_throttled_from_outside_is_a_straggler(tmp_path):
    """Throttle rank 1 the way a CPU quota does: stopped 85% of every 100 ms, from this test, not by a flag."""
    import threading

    process, pids = _start(tmp_path, "--matmul-seconds", "3", "--sizes", "1K", "--deadline-s", "20", "--straggler-factor", "1.5")
    done = threading.Event()

    def throttle():
        while not done.is_set() and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[1], signal.SIGSTOP)
                time.sleep(0.085)
                os.kill(pids[1], signal.SIGCONT)
            time.sleep(0.015)

    thread = threading.Thread(target=throttle, daemon=True)
    thread.start()
    try:
        out, _ = process.communicate(timeout=120)
    finally:
        done.set()
        thread.join()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGCONT)
    report = json.loads(out)
    speeds = [r["matmul_gflops"] for r in report["ranks"]]
    assert [s["rank"] for s in report["stragglers"]] == [1], speeds
    assert report["stragglers"][0]["host"] and process.returncode != 0


def test_a_dead_rank_is_reported_not_hung_on(tmp_path):
    process, pids = _start(tmp_path, "--deadline-s", "4", "--matmul-seconds", "2")
    os.kill(pids[1], signal.SIGKILL)
    out, _ = process.communicate(timeout=60)
    report = json.loads(out)
    assert process.returncode != 0 and not report["ok"]
    assert {"rank": 1, "signal": "SIGKILL"} in report["died"]
