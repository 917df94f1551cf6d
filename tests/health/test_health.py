"""`dmt health`: the arithmetic and judgements on their own, then real gloo ranks: healthy (spawned, torchrun, srun
environment, two simulated nodes), a stopped rank, a rank stuck before a collective, a throttled rank, a killed rank."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import free_port
from toolkit.cli.health import matmul_spread
from toolkit.errors import UserInputError
from toolkit.health.analysis import find_slow_links, find_stragglers, find_suspects, numa_mismatch
from toolkit.health.checks import match_gpu, parse_cpulist
from toolkit.health.collectives import OPS, bandwidths, element_count, ring_pair_phases
from toolkit.health.options import HealthOptions, rank_env
from toolkit.health.verdict import HealthReport, incomplete, judge, thresholds_for
from toolkit.runtime.watchdog import Beat, LivenessTracker, Observation, find_unresponsive, parse_beat

DMT = [sys.executable, "-m", "toolkit"]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
# A healthy run's verdict may not depend on how a loaded machine shares its cores between the ranks: stragglers are
# judged only where the test makes one (test_a_rank_throttled_from_outside_is_a_straggler)
CALM = ["--straggler-factor", "1000", "--matmul-seconds", "0.5"]
# Every time bound below is a hang guard, never a verdict: how long a test waits for an event of a run (the ranks'
# pids, a step reached, the report). A whole healthy 2-rank run took ~20 s at load ~10 on 2 cores; a hang verdict
# comes ~5 s after the fault: 300 s is 15x the one, 60 s 12x the other.
EVENT_GUARD_S = 300
VERDICT_GUARD_S = 60


# ---- pure arithmetic and judgement -------------------------------------------------------------------------------

def test_bandwidths_follow_nccl_tests():
    assert bandwidths("all_reduce", 8e9, 1.0, 8) == pytest.approx((8.0, 8.0 * 2 * 7 / 8))
    assert bandwidths("all_gather", 8e9, 2.0, 4) == pytest.approx((4.0, 3.0))
    assert bandwidths("reduce_scatter", 4e9, 1.0, 2) == pytest.approx((4.0, 2.0))
    assert bandwidths("broadcast", 1e9, 1.0, 16) == pytest.approx((1.0, 1.0))
    assert bandwidths("sendrecv", 3e9, 2.0, 64) == pytest.approx((1.5, 1.5))
    assert element_count("all_gather", 1000, 3) == 249 and element_count("all_reduce", 1000, 3) == 250


@pytest.mark.parametrize("world", range(2, 10))
def test_ring_pair_phases_time_every_link_apart(world):
    phases = ring_pair_phases(world)
    links = [pair for phase in phases for pair in phase]
    expected = {(0, 1)} if world == 2 else {(r, (r + 1) % world) for r in range(world)}
    assert set(links) == expected and len(links) == len(expected)
    for phase in phases:  # no rank in two pairs of one phase
        ranks = [r for pair in phase for r in pair]
        assert len(ranks) == len(set(ranks))
    assert len(phases) == (1 if world == 2 else 2 + world % 2)


def test_stragglers_against_the_others_median():
    assert [s["rank"] for s in find_stragglers([1.0, 3.1], ["a", "b"], 3.0)] == [1]
    assert find_stragglers([1.0, 2.9], ["a", "b"], 3.0) == []
    found = find_stragglers([1.0, 1.1, 0.9, 2.5, 1.0], list("aabbc"), 2.0)
    assert [(s["rank"], s["host"]) for s in found] == [(3, "b")] and found[0]["ratio"] == pytest.approx(2.5)


def test_slow_links_are_judged_within_their_tier_and_localised():
    hosts = ["a", "a", "b", "b", "c", "c"]
    gbps = {(0, 1): 100, (1, 2): 10, (2, 3): 100, (3, 4): 10, (4, 5): 20, (5, 0): 10}  # (4,5): intra, 5x slow
    links = [{"src": s, "dst": d, "gbps": g} for (s, d), g in gbps.items()]
    slow = find_slow_links(links, hosts, 2.0)
    assert [(s["src"], s["dst"], s["tier"]) for s in slow] == [(4, 5, "intra")]  # inter links are not held to NVLink
    assert find_suspects(links, slow, hosts) == [{"rank": None, "host": "c", "why": "all of its intra-node links are slow"}]
    with_floor = find_slow_links(links, hosts, 2.0, {"inter": 15.0})
    assert {(s["src"], s["dst"]) for s in with_floor} == {(1, 2), (3, 4), (4, 5), (5, 0)}
    ring = [{"src": r, "dst": (r + 1) % 4, "gbps": 1 if r in (1, 2) else 50} for r in range(4)]
    suspects = find_suspects(ring, find_slow_links(ring, ["x"] * 4, 2.0), ["x"] * 4)
    assert suspects == [{"rank": 2, "host": "x", "why": "both of its ring links are slow"}]  # the rank, not a link


def _seen(rank, beat_age=0.1, step=5, age=0.1, done=False, ever=True, name="all_reduce 1024 B", ops=3, uniform=True):
    return Observation(rank, f"h{rank}", beat_age, ever, Beat(9, step, done, ops, uniform, name), age)


def test_unresponsive_ranks_are_named_with_the_reason():
    assert find_unresponsive([_seen(0), _seen(1)], 5.0) == []
    stopped = find_unresponsive([_seen(0), _seen(1, beat_age=6.0)], 5.0)
    assert [(u["rank"], u["host"]) for u in stopped] == [(1, "h1")] and "heartbeat" in stopped[0]["reason"]
    assert find_unresponsive([_seen(0), _seen(1, beat_age=6.0, ever=False)], 5.0)[0]["reason"] == "never started"
    late = find_unresponsive([_seen(0, step=7, age=6.0, name="broadcast 1 B"), _seen(1, step=6, age=9.0)], 5.0)
    assert [u["rank"] for u in late] == [1] and "did not arrive at 'broadcast 1 B'" in late[0]["reason"]
    assert find_unresponsive([_seen(0, step=7, age=4.0), _seen(1, step=6, age=9.0)], 5.0) == []  # not late yet
    assert find_unresponsive([_seen(0, step=7, age=9.0), _seen(1, step=6, age=1.0)], 5.0) == []  # still moving
    stuck = find_unresponsive([_seen(0, age=6.0), _seen(1, age=7.0)], 5.0)
    assert [u["rank"] for u in stuck] == [0, 1] and "never completed" in stuck[0]["reason"]
    lagging = find_unresponsive([_seen(0, age=6.0, ops=8), _seen(1, age=7.0, ops=5), _seen(2, age=6.5, ops=8)], 5.0)
    assert [u["rank"] for u in lagging] == [1] and "collective #6 of 'all_reduce 1024 B'" in lagging[0]["reason"]
    pairs = find_unresponsive([_seen(0, age=6.0, ops=8, uniform=False), _seen(1, age=7.0, ops=2, uniform=False)], 5.0)
    assert [u["rank"] for u in pairs] == [0, 1]  # pairwise steps issue different counts by design: no one to blame
    assert find_unresponsive([_seen(0, beat_age=60, done=True), _seen(1)], 5.0) == []  # finished is not hung
    # before the first step (step -1, the start) a run has the startup allowance, not the step deadline; a frozen
    # heartbeat is still named at the deadline, and once every rank is in a step the deadline holds again
    starting = [_seen(0, step=-1, age=12.0, name="start"), _seen(1, step=-1, age=12.0, name="start")]
    assert find_unresponsive(starting, 10.0, startup_s=20.0) == []
    assert "never completed" in find_unresponsive(starting, 10.0, startup_s=11.0)[0]["reason"]
    assert [u["rank"] for u in find_unresponsive(starting, 10.0)] == [0, 1]
    behind = [_seen(0, step=0, age=12.0, name="step 1 train"), _seen(1, step=-1, age=12.0, name="start")]
    assert find_unresponsive(behind, 10.0, startup_s=20.0) == []
    assert find_unresponsive([starting[0], _seen(1, step=-1, beat_age=11.0)], 10.0, startup_s=20.0)[0]["rank"] == 1
    assert find_unresponsive([_seen(0, age=12.0), _seen(1, age=12.0)], 10.0, startup_s=20.0) != []
    # frozen just after its last beat: while the others' wait passes the deadline its heartbeat is only stale, and
    # with stale_s it is named for that (stopped), not as a live rank that is late
    frozen = [_seen(0, age=6.0, ops=8), _seen(1, age=7.0, ops=5, beat_age=3.0)]
    assert "did not arrive" in find_unresponsive(frozen, 5.0)[0]["reason"]
    [named] = find_unresponsive(frozen, 5.0, stale_s=2.0)
    assert named["rank"] == 1 and named["silent_s"] == 3.0 and named["reason"].startswith("no heartbeat")
    assert find_unresponsive([_seen(0, age=6.0, ops=8), _seen(1, age=7.0, ops=5)], 5.0, stale_s=2.0) == lagging
    assert find_unresponsive([_seen(0), _seen(1, beat_age=3.0)], 5.0, stale_s=2.0) == []  # stale alone is no hang
    never = find_unresponsive([_seen(0, beat_age=6.0, ever=False), _seen(1)], 5.0, stale_s=2.0)
    assert [u["reason"] for u in never] == ["never started"]  # still told apart from a stopped one


def test_liveness_is_judged_on_the_readers_clock():
    tracker = LivenessTracker(2, started=100.0)
    seen = tracker.observe({0: parse_beat(b"3 0 run 0 1 matmul")}, ["a", None], now=101.0)
    assert seen[0].beat_age_s == 0 and seen[1].beat_age_s == 1.0 and not seen[1].ever_seen
    beats = {0: parse_beat(b"5 0 run 0 1 matmul"), 1: parse_beat("1 -1 run 0 1 start")}
    seen = tracker.observe(beats, ["a", "b"], now=104.0)
    assert seen[0].beat_age_s == 0 and seen[0].progress_age_s == 3.0 and seen[1].beat_age_s == 0
    beats = {0: parse_beat(b"6 0 run 2 1 matmul"), 1: parse_beat("1 -1 exit 0 0 x y")}
    seen = tracker.observe(beats, ["a", "b"], now=105.0)
    assert seen[0].progress_age_s == 0 and seen[0].beat.ops == 2 and seen[1].beat.finished
    assert seen[1].beat_age_s == 1.0 and seen[1].beat.name == "x y" and not seen[1].beat.uniform


def test_gpu_names_map_to_the_catalogue():
    from toolkit.spec.cluster import load_catalogue

    catalogue = {name: gpu.name for name, gpu in load_catalogue().items()}
    assert match_gpu("NVIDIA H100 80GB HBM3", catalogue) == "h100-80gb"
    assert match_gpu("NVIDIA H100 PCIe", catalogue) == "h100-pcie"
    assert match_gpu("NVIDIA A100-SXM4-40GB", catalogue) == "a100-40gb"
    assert match_gpu("NVIDIA GeForce RTX 4090", catalogue) == "rtx-4090"
    assert match_gpu("AMD Instinct MI300X", catalogue) == "mi300x"
    assert match_gpu("Tesla T4", catalogue) is None


def test_host_facts_helpers():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert numa_mismatch({"gpu_numa_node": 1, "numa_nodes": [0], "numa_node_count": 2}).endswith("NUMA node 1")
    assert numa_mismatch({"gpu_numa_node": 1, "numa_nodes": [0, 1], "numa_node_count": 2}) is None


def test_launchers_are_recognised():
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "n0",
                "MASTER_PORT": "29400", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    env = rank_env(torchrun)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.agent_store) == (3, 8, 3, 4, True)
    srun = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "8",
            "MASTER_ADDR": "n0"}
    env = rank_env(srun)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.master_port) == (5, 16, 1, 8, 29500)
    assert not env.agent_store and rank_env({"PATH": "/bin"}) is None
    deepspeed = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "MASTER_ADDR": "n0",
                 "MASTER_PORT": "29500"}  # the deepspeed launcher names the ranks per node LOCAL_SIZE
    assert rank_env(deepspeed).local_world_size == 2
    with pytest.raises(UserInputError, match="MASTER_ADDR"):
        rank_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


def test_thresholds_come_from_the_catalogue_and_flags_override_them():
    from toolkit.spec.cluster import get_gpu

    h100 = get_gpu("h100-80gb")
    limits = thresholds_for(HealthOptions(), h100, cuda=True, local_world_size=8)
    assert limits.min_intra_busbw_gbps == pytest.approx(0.5 * h100.intra_node_bw_gbps)
    assert limits.min_inter_busbw_gbps == pytest.approx(0.5 * h100.inter_node_bw_gbps)
    assert limits.peak_gflops == pytest.approx(h100.peak_tflops["bf16"] * 1e3) and limits.expected_devices == 8
    limits = thresholds_for(HealthOptions(min_busbw_gbps=300, expected_devices=4), h100, cuda=True, local_world_size=8)
    assert limits.min_intra_busbw_gbps == 300 and limits.expected_devices == 4
    cpu = thresholds_for(HealthOptions(), None, cuda=False, local_world_size=2)
    assert (cpu.min_intra_busbw_gbps, cpu.peak_gflops, cpu.expected_devices, cpu.source) == (None, None, None, "cpu defaults")


def test_judge_names_wrong_results_stragglers_and_differing_nccl_settings():
    ranks = [{"host": h, "device": "cpu", "matmul_ms": ms, "matmul_gflops": 1.0, "env": env}
             for h, ms, env in (("a", 1.0, {}), ("a", 1.1, {}), ("b", 5.0, {"NCCL_IB_HCA": "mlx5_0"}))]
    row = {"bytes": 1024, "time_s": 1e-4, "algbw_gbps": 0.01, "busbw_gbps": 0.01}
    collectives = {"all_reduce": {"1024": row | {"correct": True}, "4096": row | {"bytes": 4096, "correct": False}}}
    report = judge(ranks, collectives, {"intra_node_busbw_gbps": None, "inter_node_busbw_gbps": None}, [], HealthOptions())
    assert not report.ok and report.hosts == ["a", "b"]
    assert [(s.rank, s.host) for s in report.stragglers] == [(2, "b")]
    assert "rank 2 (b) is a straggler by compute: matmul 5.00 ms vs 1.05 ms median on the other ranks (4.8x)" \
        in report.problems  # named by its term, as `dmt report --breakdown` names a run's slowest rank
    assert matmul_spread([{"rank": i, **facts} for i, facts in enumerate(ranks)]) == (
        "per-rank spread (slowest less fastest rank): matmul 4.00 ms, all of it compute (the one term measured "
        "here); slowest rank: 2 (b)")
    assert matmul_spread([{"rank": 0, **ranks[0]}]) is None
    assert any("all_reduce of 4096 B returned wrong values" in p for p in report.problems)
    assert any(w.startswith("NCCL_IB_HCA differs") for w in report.warnings)


def test_judge_holds_gpus_to_the_catalogue():
    """GPU facts as two H100 ranks would report them: one sees 7 of 8 GPUs, shares a GPU and runs at 10% of peak."""
    gpu = {"host": "n0", "gpu_name": "NVIDIA H100 80GB HBM3", "local_world_size": 8, "matmul_ms": 1.0, "env": {}}
    ranks = [gpu | {"device": "cuda:0", "gpu_uuid": "GPU-a", "visible_devices": 8, "matmul_gflops": 700e3},
             gpu | {"device": "cuda:1", "gpu_uuid": "GPU-a", "visible_devices": 7, "matmul_gflops": 99e3}]
    report = judge(ranks, {}, {"intra_node_busbw_gbps": 100.0, "inter_node_busbw_gbps": None}, [], HealthOptions())
    assert report.gpu == "h100-80gb" and report.thresholds.source == "catalogue h100-80gb"
    assert report.ranks[0].matmul_fraction_of_peak == pytest.approx(700e3 / 989.4e3)
    problems = "\n".join(report.problems)
    assert "rank 1 (n0) sees 7 GPUs, expected 8" in problems and "ranks 0, 1 on n0 share GPU GPU-a" in problems
    assert "rank 1 (n0): matmul at 10% of the bf16 peak" in problems and "rank 0 (n0): matmul" not in problems
    assert "intra-node all_reduce busbw 100.00 GB/s below the floor 225" in problems
    one_each = [r | {"visible_devices": 1, "gpu_uuid": f"GPU-{i}", "matmul_gflops": 700e3} for i, r in enumerate(ranks)]
    bandwidth = {"intra_node_busbw_gbps": 400.0, "inter_node_busbw_gbps": None}
    assert judge(one_each, {}, bandwidth, [], HealthOptions()).ok  # srun --gpus-per-task=1: one GPU each is right


def test_the_report_reads_back_as_it_was_written():
    """Every report has the same keys in the same order (a rank's report ends with who wrote it); only a GPU rank's
    facts name its GPU; JSON read back and written again is unchanged."""
    ranks = [{"host": "a", "pid": 7, "device": "cpu", "matmul_ms": 1.0, "matmul_gflops": 1.0, "env": {},
              "memory_check": None}] * 2
    complete = judge(ranks, {}, {"intra_node_busbw_gbps": None}, [], HealthOptions()).model_copy(
        update={"reported_by": 0}).as_json()
    cut = incomplete(2, ["a", None], "failure", [], [{"rank": 1, "host": None, "how": "exited with code 1"}], []).as_json()
    assert list(complete) == [*cut, "reported_by"] and cut["thresholds"] == {} and complete["thresholds"]["source"]
    assert complete["ranks"][1] == {"rank": 1, **ranks[1]}  # nothing added, a null measured kept
    for report in (complete, cut):
        assert HealthReport.model_validate_json(json.dumps(report)).as_json() == report


def test_sizes_read_like_nccl_tests():
    from toolkit.cli.health import parse_sizes

    assert parse_sizes("1K,64K,1M,16M") == (1 << 10, 1 << 16, 1 << 20, 1 << 24)
    assert parse_sizes("4MB,2GiB,512") == (512, 4_000_000, 2 << 30)
    with pytest.raises(UserInputError, match="--sizes"):
        parse_sizes("2")


# ---- the command line ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, named", [
    (["--nproc", "2", "--matmul-seconds", "30", "--deadline-s", "10"], "--matmul-seconds"),
    (["--nproc", "2", "--sizes", "1K,lots"], "--sizes"),
    (["--nproc", "0"], "--nproc"),
    (["--nproc", "2", "--straggler-factor", "0.5"], "--straggler-factor"),
    (["--gpu", "h900"], "--gpu"),
    ([], "--nproc"),  # no launcher environment and no --nproc
])
def test_bad_input_is_one_line_and_exit_2(flags, named):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    result = subprocess.run([*DMT, "health", *flags], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2 and named in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


# ---- real ranks ----------------------------------------------------------------------------------------------------

@pytest.mark.launch
def test_two_local_ranks_are_healthy(tmp_path):
    """Read through a pipe, as in a CI or Slurm log: the table keeps a host name longer than any terminal whole."""
    out = tmp_path / "health.json"
    host = "node-" + "with-a-name-longer-than-any-table-column-" * 4 + "7"
    result = subprocess.run([*DMT, "health", "--nproc", "2", "--sizes", "1K,1M,4M", "--output", str(out), *CALM],
                            capture_output=True, text=True, timeout=EVENT_GUARD_S,
                            env=dict(os.environ, DMT_HEALTH_HOSTNAME=host))
    report = json.loads(out.read_text())
    assert result.returncode == 0 and report["ok"], report["problems"]
    assert "healthy" in result.stdout and "busbw GB/s" in result.stdout  # the human table
    assert report["hosts"] == [host] and host in result.stdout and "…" not in result.stdout
    assert report["world_size"] == 2 and report["phase"] == "complete" and report["unresponsive"] == report["died"] == []
    for op in OPS:
        rows = report["collectives"][op]
        assert set(rows) == {"1024", str(1 << 20), str(4 << 20)} and all(row["correct"] for row in rows.values())
        # the figures follow nccl-tests' definitions from the time measured (how fast the machine was is no verdict:
        # under load ~10 on 2 cores a 4M op took 1-115x the time of a 1K one)
        for size, row in rows.items():
            assert row["bytes"] == element_count(op, int(size), 2) * 4 and row["time_s"] > 0
            assert (row["algbw_gbps"], row["busbw_gbps"]) == pytest.approx(bandwidths(op, row["bytes"], row["time_s"], 2))
    big = report["collectives"]["all_gather"][str(4 << 20)]
    assert big["busbw_gbps"] == pytest.approx(big["algbw_gbps"] / 2) and big["bytes"] == 4 << 20
    bandwidth = report["bandwidth"]
    assert bandwidth["intra_node_busbw_gbps"] == report["collectives"]["all_reduce"][str(4 << 20)]["busbw_gbps"]
    assert bandwidth["inter_node_busbw_gbps"] is None
    assert [(link["src"], link["dst"], link["tier"]) for link in report["links"]] == [(0, 1, "intra")]
    assert report["links"][0]["gbps"] > 0 and all(r["matmul_ms"] > 0 and r["pid"] for r in report["ranks"])


@pytest.mark.launch
def test_under_torchrun():
    cmd = [TORCHRUN, "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "toolkit", "health", "--json", "--sizes", "1K,1M", *CALM]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=EVENT_GUARD_S)
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert result.returncode == 0 and report["ok"] and report["world_size"] == 2, report["problems"]
    assert report["ranks"][1]["local_world_size"] == 2


@pytest.mark.launch
def test_under_an_srun_environment_where_rank_0_hosts_the_store():
    """Two tasks as srun starts them (SLURM_* and MASTER_ADDR/PORT, no launcher agent holding a store)."""
    port = str(free_port())
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE")}
    procs = [subprocess.Popen([*DMT, "health", "--json", "--sizes", "1K,1M", *CALM], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True,
                              env=dict(base, SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r),
                                       SLURM_NTASKS_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in (0, 1)]
    outputs = [proc.communicate(timeout=EVENT_GUARD_S)[0] for proc in procs]
    report = _report(outputs[0])
    assert [proc.returncode for proc in procs] == [0, 0] and report["ok"], report["problems"]
    assert report["world_size"] == 2 and report["ranks"][1]["local_world_size"] == 2 and outputs[1] == ""


@pytest.mark.launch
def test_two_nodes_measure_inter_node_bandwidth(tmp_path):
    """Two torchrun 'nodes' on this machine, told apart by DMT_HEALTH_HOSTNAME: the link between them is inter-node."""
    port = str(free_port())
    procs = [subprocess.Popen([TORCHRUN, "--nnodes", "2", "--node_rank", str(n), "--nproc_per_node", "1",
                               "--master_addr", "127.0.0.1", "--master_port", port, "-m", "toolkit", "health",
                               "--output", str(tmp_path / f"node{n}.json"), "--sizes", "1K,1M", *CALM],
                              env=dict(os.environ, DMT_HEALTH_HOSTNAME=f"node-{n}"), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for n in (0, 1)]
    codes = [proc.wait(timeout=EVENT_GUARD_S) for proc in procs]
    report = json.loads((tmp_path / "node0.json").read_text())
    assert codes == [0, 0] and report["ok"] and report["hosts"] == ["node-0", "node-1"], report["problems"]
    assert report["bandwidth"]["inter_node_busbw_gbps"] > 0 and report["bandwidth"]["intra_node_busbw_gbps"] is None
    assert report["links"][0]["tier"] == "inter" and not (tmp_path / "node1.json").exists()  # one report per job


def _pids(pid_dir: Path) -> dict[int, int]:
    """The ranks' pids written so far (a file still being written, empty or partial, does not count yet)."""
    pids = {}
    for rank in (0, 1):
        with contextlib.suppress(OSError, ValueError):
            pids[rank] = int((pid_dir / f"rank{rank}.pid").read_text())
    return pids


def _start(tmp_path, launcher, *flags):
    """A health run whose ranks write their pids; returns once both ranks' heartbeats are running (each writes its
    pid once its heartbeat runs)."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    cmd = [*launcher, "health", "--json", "--pid-dir", str(pid_dir), *flags]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + EVENT_GUARD_S
    while len(_pids(pid_dir)) < 2 and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.02)
    pids = _pids(pid_dir)
    assert len(pids) == 2, f"the ranks never wrote their pids (exit code {process.poll()})"
    return process, pids


def _wait_for_step(process, tmp_path, rank: int, reached) -> str:
    """The step `rank` is in (rank<N>.step in --pid-dir names each step as the rank enters it), once reached(it)."""
    path, deadline, name = tmp_path / "pids" / f"rank{rank}.step", time.monotonic() + EVENT_GUARD_S, None
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(FileNotFoundError):
            name = path.read_text()
            if reached(name):
                return name
        time.sleep(0.01)
    pytest.fail(f"rank {rank} never reached the step awaited (last in '{name}', exit code {process.poll()})")


def _report(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{"):])


@pytest.mark.launch
@pytest.mark.parametrize("stopped", [1, 0], ids=["rank1", "rank0-the-reporter"])
def test_a_stopped_rank_is_named_unresponsive_within_the_deadline(tmp_path, stopped):
    """The rank is stopped wherever it is (its heartbeat was running: _start); the other rank's monitor (or the
    spawner's) names it once its heartbeat has been silent for the deadline."""
    deadline = 4.0
    process, pids = _start(tmp_path, DMT, "--nproc", "2", "--deadline-s", str(deadline), "--matmul-seconds", "2")
    os.kill(pids[stopped], signal.SIGSTOP)
    try:
        out, _ = process.communicate(timeout=VERDICT_GUARD_S)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the spawner ends stopped ranks itself
            os.kill(pids[stopped], signal.SIGKILL)
    report = _report(out)
    assert process.returncode == 1 and not report["ok"] and report["phase"] == "hang"
    assert [(u["rank"], u["host"]) for u in report["unresponsive"]] == [(stopped, report["hosts"][0])]
    assert report["died"] == [] and report["reported_by"] == 1 - stopped
    # not before the deadline, on the monitor's own clock (the one the verdict is made on: an outside clock also
    # counts the time load delayed the rank's last beat by)
    [named] = report["unresponsive"]
    assert named["silent_s"] >= deadline and named["step"], named


def _freeze_main_thread(pid: int) -> None:
    """Stop only the main thread of `pid` (ptrace), leaving its heartbeat thread running: a rank alive but stuck.

    Waits until the thread sleeps (in a collective's wait, which releases the GIL), so the heartbeat can go on.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    stat = Path(f"/proc/{pid}/task/{pid}/stat")
    end = time.monotonic() + 10
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "S" and time.monotonic() < end:
        time.sleep(0.001)
    for request in (0x4206, 0x4207):  # PTRACE_SEIZE, PTRACE_INTERRUPT: a stop of this thread only
        if libc.ptrace(request, pid, None, None) != 0:
            pytest.skip(f"ptrace refused (errno {ctypes.get_errno()})")


@pytest.mark.launch
def test_a_rank_stuck_before_a_collective_is_named_while_its_heartbeat_runs(tmp_path):
    process, pids = _start(tmp_path, DMT, "--nproc", "2", "--deadline-s", "5", "--matmul-seconds", "0.5",
                           "--sizes", "1K,64K,1M,4M", "--iters", "20")
    # Frozen in the collective sweep (5 ops x 4 sizes x 20 iterations: seconds), once rank 1 has entered its first
    # op, and (_freeze_main_thread) once its main thread blocks: frozen still inside init_process_group, both ranks
    # would be in one step, named as 'never completed on any rank'.
    _wait_for_step(process, tmp_path, 1, lambda name: name.split()[0] in OPS)
    try:
        _freeze_main_thread(pids[1])
        started = time.monotonic()
        while process.poll() is None and time.monotonic() - started < VERDICT_GUARD_S:
            with contextlib.suppress(ChildProcessError):  # the tracer must reap the traced rank, or its parent waits
                os.waitpid(pids[1], os.WNOHANG | 0x40000000)  # __WALL
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pids[1], signal.SIGKILL)
            os.waitpid(pids[1], 0x40000000)
    report = _report(process.communicate(timeout=30)[0])
    assert process.returncode == 1 and report["phase"] == "hang" and report["died"] == []
    assert [u["rank"] for u in report["unresponsive"]] == [1], report["unresponsive"]
    [named] = report["unresponsive"]
    assert "did not arrive" in named["reason"] and named["silent_s"] >= 5  # alive (heartbeat), but not at the collective


@pytest.mark.launch
def test_a_rank_throttled_from_outside_is_a_straggler(tmp_path):
    """Throttle rank 1 the way a CPU quota does: stopped 85% of every 100 ms, by this test, not by a flag.

    Margin: rank 1 gets ~15% of the CPU time rank 0 gets, so its matmul is ~6.7x slower; the straggler factor is 2
    (3.3x of slack). Load on the machine slows both ranks alike and leaves the ratio; a loaded test process that
    oversleeps its 15 ms run gaps (say to 30 ms) still leaves rank 1 stopped 74% of the time: ~3.8x. The 3 s matmul
    window averages over ~30 throttle periods; the 20 s deadline is far above the 85 ms stops of rank 1's heartbeat."""
    process, pids = _start(tmp_path, DMT, "--nproc", "2", "--matmul-seconds", "3", "--sizes", "1K", "--deadline-s", "20")
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
        out, _ = process.communicate(timeout=EVENT_GUARD_S)
    finally:
        done.set()
        thread.join()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGCONT)
    report = _report(out)
    times = [r["matmul_ms"] for r in report["ranks"]]
    assert [(s["rank"], s["host"]) for s in report["stragglers"]] == [(1, report["hosts"][0])], times
    assert process.returncode == 1 and report["unresponsive"] == [] and any("straggler" in p for p in report["problems"])


@pytest.mark.launch
@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_a_dead_rank_is_reported_not_hung_on(tmp_path, launcher):
    if launcher == "spawn":
        cmd, flags = DMT, ["--nproc", "2"]
    else:
        cmd, flags = [TORCHRUN, "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "toolkit"], []
    process, pids = _start(tmp_path, cmd, *flags, "--deadline-s", "30", "--matmul-seconds", "2")
    # Killed once the process group is up (rank 1 has left init_process_group): rank 0's next collective then finds
    # the broken connection. Killed inside the rendezvous, no connection would break.
    _wait_for_step(process, tmp_path, 1, lambda name: name != "init_process_group")
    os.kill(pids[1], signal.SIGKILL)
    out, _ = process.communicate(timeout=VERDICT_GUARD_S)
    report = _report(out)
    assert process.returncode != 0 and not report["ok"] and report["phase"] == "failure"
    assert [d["rank"] for d in report["died"]] == [1] and report["unresponsive"] == []
    if launcher == "spawn":
        assert report["died"][0]["how"] == "killed by SIGKILL"
    # found by rank 0 through the broken connection and the heartbeat, not by its 30 s deadline (phase 'hang') nor by
    # the spawner's backstop, which reports without reported_by: rank 0 reports ~4 s after the kill (the rest of the
    # 2 s matmul, the failure report's 1.5 s heartbeat check), the spawner's backstop waits 15 s
    assert report["reported_by"] == 0
