"""Faults in an FSDP2 run (HF Trainer + Accelerate's FSDP2 plugin, fully_shard over 2 CPU ranks, DCP checkpoints)
through the generated launch.sh: a rank SIGKILLed after a save (torchrun restarts the job from the checkpoint and it
ends as the uninterrupted run does, to the bit), a rank SIGKILLed while a checkpoint is written in the background
(training.async_save: `latest` stays on the checkpoint before, the restarted job ends as the uninterrupted run), a
rank frozen while a checkpoint is written (named, the job fails, `latest` stays on the verified checkpoint before),
the guard's skip (no parameter shard or Adam moment moves) and its rollback (the DCP shards of the last verified
checkpoint reloaded in place); and NVRx's in-process restart (training.restart: in_process), a hot spare replacing
a killed rank inside the surviving process. The uninterrupted run saves in the background (async_save), the others as CPU ranks
do by default (synchronously): each compares with the other to the bit.
The DeepSpeed and Megatron-Core versions: tests/training/test_faults.py and tests/megatron/test_megatron_faults.py."""


import json
import re

import pytest
import torch

from helpers import (
    assert_restarted_in_process,
    free_port,
    guard_looks,
    guard_probe_env,
    kill_rank_after_save,
    launch_watched,
    pid_recorder,
)
from toolkit.checkpoint.manifest import MANIFEST, resolve_latest
from toolkit.checkpoint.verify import verify
from toolkit.cli.main import main
from toolkit.generate.ft_launcher import calculated_bounds
from toolkit.runtime.ftmonitor import STATE_FILE
from toolkit.runtime.incident import read_incidents
from toolkit.runtime.metrics import METRICS_FILE, read_checkpoint_records, read_metrics

pytestmark = pytest.mark.launch
STEPS, HANG_TIMEOUT_S = 6, 10
COMPARED = ("loss", "grad_norm", "learning_rate", "data_sha")
FAULTY = {"max_steps": STEPS, "save_steps": 2, "hang_timeout_s": HANG_TIMEOUT_S, "max_restarts": 1}
FSDP_PLAN = {"backend": "fsdp", "micro_batch": 4, "precision": "bf16"}


@pytest.fixture(scope="module")
def fsdp_launch(variant, tmp_path_factory):
    """run(name, act(process, out), DMT_FAULT, **training) -> (rc, output directory, log): the generated launch.sh of
    an FSDP2 variant of the tiny recipe under torchrun (one generation per training change)."""
    root = tmp_path_factory.mktemp("fsdp-faults")

    def run(name: str, act=None, fault: str = "", launcher: str = "torchrun", env: dict | None = None, **training):
        recipe = variant(f"tiny-fsdp-{name}", training={**FAULTY, **training}, replace={"plan": FSDP_PLAN})
        generated = root / f"{name}-generated"
        assert main(["generate", str(recipe), "--out", str(generated)]) == 0
        out = root / name
        changes = {"OUTPUT_DIR": str(out), "MASTER_PORT": str(free_port()), "DMT_FAULT": fault,
                   **guard_probe_env(run.probe(name)), **(env or {})}
        rc = launch_watched(["bash", str(generated / "launch.sh"), launcher], root / f"{name}.log",
                            (lambda process: act(process, out)) if act else (lambda process: True), changes)
        return rc, out, root / f"{name}.log"

    run.probe = lambda name: root / f"{name}.probe"  # the guard's looks at the gradients (helpers.guard_looks)
    run.log = lambda name: root / f"{name}.log"
    run.out = lambda name: root / name
    return run


@pytest.fixture(scope="module")
def reference(fsdp_launch):
    rc, out, log = fsdp_launch("reference", async_save=True)
    assert rc == 0 and [r["step"] for r in read_metrics(out)] == list(range(1, STEPS + 1)), log.read_text()[-3000:]
    assert (out / "sharding.json").is_file()  # trained sharded: the post-preparation check wrote what each rank held
    return read_metrics(out)


def test_the_uninterrupted_run_wrote_its_checkpoints_in_the_background_while_it_trained(fsdp_launch, reference):
    """metrics.jsonl in the order it was written: each checkpoint's record (written once every rank's DCP files are
    complete) comes after the record of the step after it, which trained while the files were written; a synchronous
    save's record comes right after its own step. The checkpoint at the last step completes at the end of training."""
    out = fsdp_launch.out("reference")
    lines = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    order = [f"checkpoint-{r['step']}" if r.get("kind") == "checkpoint" else r["step"] for r in lines]
    assert [o for o in order if isinstance(o, int)] == list(range(1, STEPS + 1)), order
    assert [o for o in order if isinstance(o, str)] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"], order
    for step in (2, 4):  # completed at the start of step + 2 at the earliest (each step polls once, at its start)
        assert order.index(f"checkpoint-{step}") > order.index(step + 1), order
    saves = read_checkpoint_records(out)
    assert all(r["async"] and r["blocking_s"] <= r["persist_s"] for r in saves), saves
    for step in (2, 4, 6):
        assert verify(out / f"checkpoint-{step}").ok


def _dcp(ckpt, tmp_path) -> dict:
    """Every tensor of an FSDP2 checkpoint's DCP directories (model and optimizer), gathered whole."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tensors = {}
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        target = tmp_path / f"{ckpt.name}-{part}.pt"
        dcp_to_torch_save(ckpt / part, target)
        flat = {}

        def walk(prefix, value):
            if isinstance(value, torch.Tensor):
                flat[prefix] = value
            elif isinstance(value, dict):
                for key, inner in value.items():
                    walk(f"{prefix}.{key}", inner)

        walk(part, torch.load(target, weights_only=False))
        tensors.update(flat)
    return tensors


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_guard_reads_one_gradient_norm_per_fsdp_step(fsdp_launch, reference):
    """The guard's cost: per optimizer step and rank one number, the global gradient norm the Trainer's clipping
    computed (one device-to-host read on a GPU), never a gradient tensor (no finite check from the toolkit's code)."""
    reads, others = guard_looks(fsdp_launch.probe("reference"))
    assert reads == {"0": STEPS, "1": STEPS} and not others, (reads, others[:5])


def test_a_killed_fsdp_rank_restarts_the_job_and_it_ends_as_the_uninterrupted_run(fsdp_launch, reference):
    """Under launch.sh's ft_launcher (NVIDIA Resiliency Extension's torchrun drop-in, ft_config.yaml): its in-job
    restart after the kill, and every rank of the restarted attempt sent its step heartbeats to NVRx's rank monitor
    (toolkit.runtime.ftmonitor). At each save NVRx calculated the heartbeat and section timeouts from the intervals it
    observed on both ranks and the toolkit set them within hang_timeout_s's bounds; the first attempt's calculation
    (at step 2's save, before the kill) is where the restarted attempt's timeouts started. torchrun's own restart: the
    DeepSpeed and Megatron-Core twins."""
    killed = []
    hang = 4 * HANG_TIMEOUT_S  # calculated timeouts are kept at least a quarter of it: a save is never near that here

    # rank 1 is held 20 s at the start of step 3 (the first launch only), so the kill lands after the save. It must
    # land within the step section's timeout NVRx calculated at step 2's save (at least hang / 4 = 10 s) of the hold,
    # or NVRx's rank monitor ends rank 1 first, and within `hang` of rank 0 blocking in step 3's first collective, or
    # the watchdog ends the job as a hang (incident 'hang', not 'failure'); it comes within a 50 ms poll and a ~0.1 s
    # process scan of `latest` naming checkpoint-2: ~50x margin idle (the DeepSpeed twin in test_faults.py says so).
    rc, out, log = fsdp_launch("restarted", kill_rank_after_save("checkpoint-2", killed),
                               "slow=20@rank=1,step=3,phase=train", launcher="ft_launcher", hang_timeout_s=hang)
    assert killed and rc == 0, log.read_text()[-3000:]
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # each step once
    for step in range(3, STEPS + 1):  # trained again after the restart, from checkpoint-2's DCP shards
        assert {k: records[step - 1][k] for k in COMPARED} == {k: reference[step - 1][k] for k in COMPARED}, step
    failure, restart = read_incidents(out)
    assert failure["event"] == "failure" and [d["rank"] for d in failure["died"]] == [1]
    assert restart["event"] == "restart" and restart["resume_from"] == "checkpoint-2"
    assert verify(resolve_latest(out)).ok
    sent = [int(n) for n in re.findall(r"ft_launcher: (\d+) heartbeats sent to NVRx's rank monitor", log.read_text())]
    assert len(sent) == 2 and min(sent) >= STEPS - 2, sent  # both ranks of the restarted attempt, each step at least
    # NVRx's calculation at the last save (step 6), the restarted attempt's third: every timeout it calculated, and
    # the one in force, NVRx's within the bounds; the first heartbeat and out of section as ft_config.yaml says
    state = json.loads((out / STATE_FILE).read_text())
    low, high = calculated_bounds(hang)
    calculated, in_force = state["calculated"], state["current_timeouts"]
    assert state["step"] == STEPS and calculated["heartbeat"]["were_calculated"], state
    assert in_force["heartbeat"] == {"initial": 2 * hang, "were_calculated": True,
                                     "subsequent": min(max(calculated["heartbeat"]["subsequent"], low), high)}, state
    assert sorted(calculated["section"]["calculated_sections"]) == ["checkpointing", "step"], state
    for name in ("step", "checkpointing"):
        assert 0 < calculated["section"]["section"][name], state
        assert in_force["section"]["section"][name] == min(max(calculated["section"]["section"][name], low), high)
    assert in_force["section"]["out_of_section"] == hang and not in_force["section"]["is_out_of_section_calculated"]
    # both ranks of the restarted attempt began from the first attempt's calculation, which ended in ft_state.json
    assert log.read_text().count(f"(calculated before, from {STATE_FILE})") == 2


def test_in_process_restart_replaces_a_killed_fsdp_rank_and_ends_as_the_uninterrupted_run(fsdp_launch, reference,
                                                                                        tmp_path):
    """training.restart: in_process on FSDP2 (NVRx's in-process Wrapper around the HF Trainer, Accelerate's FSDP2
    plugin, fully_shard over 2 gloo ranks) through launch.sh's `inprocess` launcher: 2 ranks and a hot spare. Rank 1 is
    SIGKILLed at the start of step 3, after checkpoint-2: rank 0's process is not relaunched (same pid), it builds its
    process group, Trainer, FSDP2 model and optimizer again and loads checkpoint-2's DCP shards, the spare becomes
    rank 1, every step is logged once, each equal to the uninterrupted run's, and so is every tensor of the final
    checkpoint (model and optimizer) to the bit."""
    pids: dict = {}
    # OMP_NUM_THREADS=1 as torchrun sets it for the reference's ranks: the same kernels, the same bits
    rc, out, log = fsdp_launch("in-process", pid_recorder(pids), "kill@rank=1,step=3,phase=train", launcher="inprocess",
                               env={"OMP_NUM_THREADS": "1"}, restart="in_process", spare_ranks=1, async_save=False,
                               hang_timeout_s=120)
    text = log.read_text()
    assert rc == 0 and "fault injection: kill on rank 1" in text, text[-3000:]
    assert_restarted_in_process(out, text, pids, "checkpoint-2", 3)
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [{k: r[k] for k in COMPARED} for r in records] == [{k: r[k] for k in COMPARED} for r in reference]
    got = _dcp(out / f"checkpoint-{STEPS}", tmp_path)
    want = _dcp(fsdp_launch.out("reference") / f"checkpoint-{STEPS}", tmp_path)
    assert got and _same(got, want)
    assert verify(resolve_latest(out)).ok


def test_a_rank_killed_inside_a_background_save_leaves_latest_before_it_and_the_restart_ends_as_the_reference(
        fsdp_launch, reference):
    """checkpoint-4's DCP directories are written in the background (training.async_save), each rank's writing threads
    held back 60 s before their first byte; rank 0 is SIGKILLed in step 5 while they wait: training went on without a
    byte of checkpoint-4's model or optimizer state on disk (a synchronous save would have finished them, and moved
    `latest`, before step 5), `latest` stays on checkpoint-2 and `dmt ckpt verify` rejects checkpoint-4. Rank 1, ended
    by the launcher, waits the bounded time for its writes and says so; torchrun restarts the job from checkpoint-2,
    which saves in the background again and ends as the uninterrupted run does, to the bit."""
    seen = {}

    def look_when_the_kill_comes(process, out):
        # the fault's log line comes 0.5 s before its SIGKILL; latest and checkpoint-4's files can only change once
        # torchrun has restarted the job and it trained steps 3 and 4 again, or once the held writes go on after 60 s
        if "fault injection: kill" in log.read_text() and not seen:
            partial = out / "checkpoint-4"
            seen.update(latest=resolve_latest(out).name, manifest=(partial / MANIFEST).exists(),
                        written=sorted(p.name for p in partial.glob("*/*.distcp")),
                        verify=main(["ckpt", "verify", str(partial)]))
        return bool(seen)

    log = fsdp_launch.log("kill-in-save")
    rc, out, _ = fsdp_launch("kill-in-save", look_when_the_kill_comes,
                             "slow=60@step=4,phase=persist;kill@rank=0,step=5,phase=train", async_save=True)
    assert rc == 0, log.read_text()[-3000:]
    assert {k: seen[k] for k in ("latest", "manifest", "written")} == {"latest": "checkpoint-2", "manifest": False,
                                                                       "written": []}
    assert seen["verify"] != 0
    assert (f"checkpoint-4: this rank's background write did not finish within {HANG_TIMEOUT_S} s and is "
            f"abandoned") in log.read_text()
    restart = next(e for e in read_incidents(out) if e["event"] == "restart")
    assert restart["resume_from"] == "checkpoint-2"
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for step in range(3, STEPS + 1):  # trained again from checkpoint-2, saved in the background mid-training
        assert {k: records[step - 1][k] for k in COMPARED} == {k: reference[step - 1][k] for k in COMPARED}, step
    saves = read_checkpoint_records(out)
    assert [(r["checkpoint"], r["async"]) for r in saves] == [(f"checkpoint-{s}", True) for s in (2, 4, 6)]
    for step in (2, 4, 6):
        assert verify(out / f"checkpoint-{step}").ok


def test_a_frozen_fsdp_rank_in_a_save_is_named_and_latest_stays_on_the_checkpoint_before(fsdp_launch):
    rc, out, log = fsdp_launch("frozen", fault="stop@rank=1,step=4,phase=manifest", max_restarts=0)
    assert rc != 0, log.read_text()[-3000:]
    hang = next(e for e in read_incidents(out) if e["event"] == "hang")
    [named] = hang["unresponsive"]
    assert (named["rank"], named["step"], named["phase"]) == (1, 4, "manifest"), hang
    # frozen: its heartbeat stops, and the collective before the manifest waits for it; whichever the monitor sees
    # first names it (both ~HANG_TIMEOUT_S after the stop; no bound on the time here, the run's end is the check)
    assert named["pid"] and ("no heartbeat" in named["reason"] or "did not arrive" in named["reason"]), named
    assert named.get("ended_by_watchdog") == ("SIGKILL" if "no heartbeat" in named["reason"] else None), named
    assert resolve_latest(out).name == "checkpoint-2" and verify(resolve_latest(out)).ok
    assert not (out / "checkpoint-4" / MANIFEST).exists()


def test_the_guard_skips_an_fsdp_step_without_moving_a_shard(fsdp_launch, reference, tmp_path):
    rc, out, log = fsdp_launch("guard-skip", fault="nan@step=3", save_steps=1, guard={"on_nan": "skip"}, max_restarts=0)
    assert rc == 0, log.read_text()[-3000:]
    records = read_metrics(out)
    assert records[2]["loss"] is None and records[2]["guard"][0]["action"] == "skip"
    assert all(r["loss"] is not None for r in records[3:])
    assert [{k: r[k] for k in COMPARED} for r in records[:2]] == [{k: r[k] for k in COMPARED} for r in reference[:2]]
    # the schedule did not advance either: step 4 trains at the rate step 3 would have had (as DeepSpeed's drop)
    assert records[3]["learning_rate"] == reference[2]["learning_rate"] != reference[3]["learning_rate"]
    before, skipped, after = (_dcp(out / f"checkpoint-{step}", tmp_path) for step in (2, 3, 4))
    assert any(".exp_avg" in k for k in before)  # the optimizer's moments are among the compared tensors
    assert _same(before, skipped)  # not one parameter or Adam moment moved at step 3
    assert not _same(skipped, after)
    [event] = read_incidents(out)
    assert (event["step"], event["action"], event["data_sha"]) == (3, "skip", records[2]["data_sha"])


def test_rollback_reloads_the_sharded_checkpoint_and_goes_on_past_the_spike(fsdp_launch, reference, tmp_path):
    """The DeepSpeed rollback test's twin on FSDP2: HF's resume functions reload the DCP shards in place."""
    guard = {"on_nan": "rollback", "spike_factor": 3, "window": 2}
    rc, out, log = fsdp_launch("guard-rollback", fault="spike=50@step=4", guard=guard, max_restarts=0)
    assert rc == 0, log.read_text()[-3000:]
    [event] = read_incidents(out)
    assert (event["step"], event["action"], event["checkpoint"], event["dropped_steps"]) == \
           (4, "rollback", "checkpoint-2", [3, 4]), event
    # checkpoint-4 was saved after the rollback: checkpoint-2's parameters and Adam moments (steps 3 and 4 dropped)
    restored, saved_after = (_dcp(out / f"checkpoint-{step}", tmp_path) for step in (2, 4))
    assert any(".exp_avg" in k for k in restored) and _same(restored, saved_after)
    records = read_metrics(out)
    assert [r["data_sha"] for r in records] == [r["data_sha"] for r in reference]  # the data went on, not back
    assert records[4]["loss"] != reference[4]["loss"]  # step 5 trained from checkpoint-2's model
    assert verify(resolve_latest(out)).ok


def test_a_relaunch_of_a_finished_run_trains_nothing_more(fsdp_launch, reference):
    """launch.sh resumes automatically: started again after the last save (a restart of a rank that failed on its
    way out, or a resubmitted job), it finds nothing left to train instead of HF's one step past max_steps."""
    rc, out, log = fsdp_launch("reference")  # the same output directory, now complete
    assert rc == 0, log.read_text()[-3000:]
    assert "checkpoint-6 is at step 6 of 6: nothing left to train" in log.read_text()
    assert read_metrics(out) == reference and resolve_latest(out).name == "checkpoint-6"
