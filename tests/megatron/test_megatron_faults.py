"""Faults in a Megatron-Core run of the tiny recipe (2 gloo ranks, data parallel): a rank SIGSTOPped from outside
mid-training is named within the timeout and the job ends; a rank SIGKILLed while a dist checkpoint is written in
the background leaves `latest` on the checkpoint before, and launch.sh's torchrun restarts the job from it; the guard's skip and
rollback act on Megatron-Core's optimizer step and checkpoints."""

import signal
import time

import pytest
import yaml
from megatron_helpers import BIN, TRAIN

from helpers import free_port, guard_looks, guard_probe_env, launch_watched, processes_with_env, rank_processes
from toolkit.checkpoint.dcp import DistCheckpointReader
from toolkit.checkpoint.manifest import MANIFEST, resolve_latest
from toolkit.checkpoint.verify import verify
from toolkit.cli.main import main
from toolkit.runtime.incident import read_incidents
from toolkit.runtime.metrics import read_checkpoint_records, read_metrics

pytestmark = pytest.mark.launch
STEPS, HANG_TIMEOUT_S = 6, 10
FAULTY = {"max_steps": STEPS, "save_steps": 2, "hang_timeout_s": HANG_TIMEOUT_S, "max_restarts": 1}


def _torchrun(out, recipe, log, act=lambda process: True, fault: str = "", *flags: str, env=None) -> int:
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), *TRAIN,
           "--recipe", str(recipe), "--output-dir", str(out), *flags]
    return launch_watched(cmd, log, act, {"OMP_NUM_THREADS": "1", "DMT_FAULT": fault, **(env or {})})


def _tensors(ckpt) -> dict:
    """Every tensor of a dist checkpoint (model and optimizer state), read whole."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = DistCheckpointReader(ckpt)
    return {key: reader.read(key, [0] * len(meta.size), list(meta.size)) for key, meta in reader.tensors.items()
            if isinstance(meta, TensorStorageMetadata)}


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_rank_stopped_mid_training_is_named_and_every_rank_ends(megatron_recipe, tmp_path):
    # saved synchronously: checkpoint-2 is complete before step 3 (a background write would complete at step 3's
    # poll, after the collective rank 0 waits in)
    recipe = megatron_recipe("tiny-megatron-hang", training=FAULTY)
    out, stopped = tmp_path / "run", {}

    def stop_rank_1_in_step_3(process):
        # rank 1 is slowed at the start of step 3 (30 s: a window however fast the steps run), so once step 2's
        # checkpoint is complete rank 0 waits for it; the SIGSTOP comes from outside, as a kernel or debugger freezes.
        # The real window is shorter than the 30 s: HANG_TIMEOUT_S (10 s) after rank 0 blocks in step 3's first
        # collective the watchdog finds the job stuck, and names rank 1 for a stopped heartbeat only if it has been
        # silent 2.5 s by then (else as alive but late: 'did not arrive'). So the SIGSTOP must come within ~7.5 s of
        # rank 0 blocking; it comes within a 50 ms poll and a ~0.1 s process scan of `latest` naming checkpoint-2,
        # about when rank 0 blocks: ~50x margin idle; the poll and the scan may take 5 s under load and still pass.
        latest = resolve_latest(out) if out.exists() else None
        if "pid" not in stopped and latest is not None and latest.name == "checkpoint-2":
            for victim in rank_processes(process, rank=1):
                victim.send_signal(signal.SIGSTOP)
                stopped.update(pid=victim.pid, at=time.time())
        return "pid" in stopped

    rc = _torchrun(out, recipe, tmp_path / "hang.log", stop_rank_1_in_step_3, "slow=30@rank=1,step=3,phase=train")
    assert stopped and rc != 0, (tmp_path / "hang.log").read_text()[-3000:]
    hang, collectives = read_incidents(out)  # the hang, then the flight recorder's analysis (rank 0's dump alone)
    assert collectives["event"] == "collectives" and collectives["dumps"] == [0], collectives
    [named] = hang["unresponsive"]
    # its last published heartbeat (the thread publishes a phase change a moment after it, and may not have yet)
    assert (named["rank"], named["pid"]) == (1, stopped["pid"]) and named["step"] >= 2, hang
    assert "no heartbeat" in named["reason"] and named["phase"] and named["ended_by_watchdog"] == "SIGKILL"
    import datetime

    reported = datetime.datetime.fromisoformat(hang["time"]).timestamp()
    # named at most ~HANG_TIMEOUT_S + a monitor period (0.5 s) after the stop (sooner once rank 0 has waited 10 s:
    # then 2.5 s of silence suffice), a wait on the monitor's clock that load does not lengthen; the 40 s bound
    # leaves ~29 s for the loaded parts (thread wake-ups, the report's store reads; under 1 s idle)
    assert reported - stopped["at"] <= HANG_TIMEOUT_S + 30
    latest = resolve_latest(out)
    assert latest is not None and verify(latest).ok and latest.name == hang["latest"]


def test_a_rank_killed_inside_a_background_save_leaves_latest_before_it_and_the_job_restarts_from_there(
        megatron_recipe, tmp_path, capsys):
    """checkpoint-4 is written in the background (training.async_save: true), each rank's write
    held back 60 s in its writer process; rank 0 is SIGKILLed in step 6, while that write runs (it started at step
    5's optimizer update, once the copy of the state made during step 5's forward and backward was handed over to the
    writer): training went on
    without a shard of checkpoint-4 on disk (the save did not wait for its files), `latest` stays on checkpoint-2 and
    `dmt ckpt verify` rejects checkpoint-4. Rank 1, ended by the launcher, waits the bounded time for its write and
    says so; launch.sh's torchrun restarts the job (training.max_restarts), which resumes from checkpoint-2 and
    rewrites checkpoint-4, no writer of the killed attempt writing into it. Node-local checkpoints (checkpoint.local,
    NVRx) were written at the odd steps; rank 1's copy of step 5 is lost when the kill comes (its node's local disk,
    as far as this rank is concerned): step 5 is not on every rank, so the restart reads the persistent checkpoint-2,
    not the local one, and the local checkpoints start again from there."""
    local = tmp_path / "node-local"
    recipe = megatron_recipe("tiny-megatron-kill-in-save", training={**FAULTY, "async_save": True},
                             checkpoint={"local": {"dir": str(local), "every": 1}})
    ranks = local / yaml.safe_load(recipe.read_text())["name"]
    generated = tmp_path / "gen"
    assert main(["generate", str(recipe), "--out", str(generated)]) == 0
    assert "async_save: true" in (generated / "megatron.yaml").read_text()
    out, seen = tmp_path / "run", {}

    # the fault's log line comes 0.5 s before its SIGKILL; what is looked at (latest, checkpoint-4's files) can only
    # change once torchrun has restarted the job and it has trained steps 3 and 4 again (seconds even idle), or once
    # the held writes go on after 60 s, so a 50 ms poll sees it as the kill left it with that much to spare
    def look_when_the_kill_comes(process):
        if "fault injection: kill" in log.read_text():
            partial = out / "checkpoint-4"
            seen.update(latest=resolve_latest(out).name, manifest=(partial / MANIFEST).exists(),
                        shards=sorted(p.name for p in partial.glob("*.distcp")),
                        verify=main(["ckpt", "verify", str(partial)]))
            seen["lost"] = sorted(p.name for p in (ranks / "1").glob("*.pt"))
            for lost in (ranks / "1").glob("*.pt"):
                lost.unlink()
            return True

    log = tmp_path / "kill.log"
    rc = launch_watched(["bash", str(generated / "launch.sh"), "torchrun"], log, look_when_the_kill_comes,
                        {"OUTPUT_DIR": str(out), "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
                         "DMT_FAULT": "slow=60@step=4,phase=persist;kill@rank=0,step=6,phase=train"})
    # the faults act in the first attempt only: an attempt that ended before step 6 (a hang at its start) never kills
    hangs = [e for e in read_incidents(out) if e["event"] == "hang"]
    assert seen and not hangs, (hangs, log.read_text()[-3000:])
    assert rc == 0, log.read_text()[-3000:]
    # the killed rank's writer and its results-queue manager (a process Megatron-Core spawns) end with it
    assert processes_with_env("OUTPUT_DIR", str(out)) == []
    assert {k: seen[k] for k in ("latest", "manifest", "shards")} == {"latest": "checkpoint-2", "manifest": False,
                                                                       "shards": []}
    assert seen["verify"] != 0
    assert (f"checkpoint-4: this rank's background write did not finish within {HANG_TIMEOUT_S} s and is "
            f"abandoned") in log.read_text()
    [restart] = [e for e in read_incidents(out) if e["event"] == "restart"]
    assert restart["resume_from"] == "checkpoint-2" and restart["attempt"]["torchrun"] == 1
    # the local checkpoint of step 5 was complete on both ranks when the kill came, then lost on rank 1: not read
    assert seen["lost"] == ["iter_0000005_1_local.pt"]
    assert not [e for e in read_incidents(out) if e["event"] == "local_resume"]
    assert sorted(p.relative_to(ranks).as_posix() for p in ranks.rglob("*.pt")) == [
        f"{rank}/iter_0000005_{rank}_local.pt" for rank in (0, 1)]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, STEPS + 1))
    saves = read_checkpoint_records(out)
    assert [(r["checkpoint"], r["async"]) for r in saves] == [(f"checkpoint-{s}", True) for s in (2, 4, 6)]
    for step in (2, 4, 6):
        report = verify(out / f"checkpoint-{step}")
        assert report.ok and report.format == "megatron-dist", report.problems


@pytest.fixture(scope="module")
def guarded(megatron_recipe, tmp_path_factory):
    """guarded(action) -> the output directory of a run whose guard meets an injected fault at step 3 (skip: a NaN
    loss, checkpoints every step) or 4 (rollback: a loss 50 times the median of the last 2 steps)."""
    import functools

    root = tmp_path_factory.mktemp("megatron-guard")

    @functools.cache
    def run(action: str):
        guard = {"on_nan": action, **({"spike_factor": 3, "window": 2} if action == "rollback" else {})}
        training = {**FAULTY, "guard": guard, **({"save_steps": 1} if action == "skip" else {})}
        recipe = megatron_recipe(f"tiny-megatron-{action}", training=training)
        fault = "nan@step=3" if action == "skip" else "spike=50@step=4"
        rc = _torchrun(root / action, recipe, root / f"{action}.log", fault=fault,
                       env=guard_probe_env(root / f"{action}.probe"))
        assert rc == 0, (root / f"{action}.log").read_text()[-3000:]
        return root / action

    return run


def test_skip_leaves_megatron_cores_model_and_optimizer_as_they_were(guarded):
    out = guarded("skip")
    assert _same(_tensors(out / "checkpoint-2"), _tensors(out / "checkpoint-3"))
    assert not _same(_tensors(out / "checkpoint-3"), _tensors(out / "checkpoint-4"))
    records = read_metrics(out)
    assert records[2]["loss"] is None and records[2]["guard"] == [
        {"step": 3, "action": "skip", "reason": "the loss of step 3 is nan"}]
    assert records[3]["learning_rate"] == records[2]["learning_rate"]  # the schedule did not advance either
    [event] = read_incidents(out)
    assert (event["step"], event["action"], event["data_sha"]) == (3, "skip", records[2]["data_sha"])


def test_the_guard_reads_one_gradient_norm_per_megatron_step(guarded):
    """The guard's cost: per optimizer step and rank one number, the global gradient norm Megatron-Core's clipping
    computes, never a gradient buffer (no finite check from the toolkit's code), the skipped NaN step included."""
    out = guarded("skip")
    reads, others = guard_looks(out.with_name("skip.probe"))
    assert reads == {"0": STEPS, "1": STEPS} and not others, (reads, others[:5])


def test_rollback_reloads_the_dist_checkpoint_in_place(guarded):
    out = guarded("rollback")
    [event] = read_incidents(out)
    assert (event["action"], event["checkpoint"], event["dropped_steps"]) == ("rollback", "checkpoint-2", [3, 4])
    assert _same(_tensors(out / "checkpoint-2"), _tensors(out / "checkpoint-4"))
    assert [r["step"] for r in read_metrics(out)] == list(range(1, STEPS + 1))
