"""Faults in a DeepSpeed run of the tiny recipe on 2 CPU ranks: a rank SIGKILLed after a save (the job restarts by
itself and ends as the uninterrupted run does, to the bit), a rank frozen (SIGSTOP) while a checkpoint is written
(named in incident.json within the timeout, every rank ends, `latest` stays on the verified checkpoint before), and
the NaN and loss-spike guard's three actions on an injected fault (DMT_FAULT, toolkit/runtime/faults.py)."""


import pytest
import torch

from helpers import free_port, kill_rank_after_save, launch_watched
from toolkit.checkpoint.manifest import MANIFEST, resolve_latest
from toolkit.checkpoint.verify import verify
from toolkit.cli.main import main
from toolkit.runtime.incident import read_incidents
from toolkit.runtime.metrics import read_metrics

pytestmark = pytest.mark.launch
# HANG_TIMEOUT_S: the watchdog's deadline (heartbeat and monitor every 0.5 s, toolkit/runtime/supervision.py; a
# heartbeat silent for 2.5 s counts as stopped once the job is stuck, toolkit/runtime/watchdog.py)
STEPS, HANG_TIMEOUT_S = 6, 10
COMPARED = ("loss", "grad_norm", "learning_rate", "data_sha")
# rank 1 held 20 s at the start of step 3: a window for a kill from outside, however fast the steps run. A restart
# runs without it (faults act on the first launch only). The hold is longer than HANG_TIMEOUT_S, so the watchdog, not
# the hold, bounds the window: rank 0 waits for rank 1 in step 3's first collective, and ~HANG_TIMEOUT_S later the
# watchdog would end the job as a hang; the kill must land before that (see the restarted fixture).
SLOW_AT_3 = "slow=20@rank=1,step=3,phase=train"
FAULTY = {"max_steps": STEPS, "save_steps": 2, "hang_timeout_s": HANG_TIMEOUT_S, "max_restarts": 1}


@pytest.fixture(scope="module")
def recipe(variant):
    return variant("tiny-faults", training=FAULTY)


@pytest.fixture(scope="module")
def launch_sh(recipe, tmp_path_factory):
    """The generated launch.sh of the fault recipe: run(name, launcher, act(process, out), DMT_FAULT) -> (rc, output
    directory, log)."""
    generated = tmp_path_factory.mktemp("faults-generated")
    assert main(["generate", str(recipe), "--out", str(generated)]) == 0
    root = tmp_path_factory.mktemp("faults-runs")

    def run(name: str, launcher: str, act=None, fault: str = ""):
        out = root / name
        changes = {"OUTPUT_DIR": str(out), "MASTER_PORT": str(free_port()), "DMT_FAULT": fault}
        rc = launch_watched(["bash", str(generated / "launch.sh"), launcher], root / f"{name}.log",
                            (lambda process: act(process, out)) if act else (lambda process: True), changes)
        return rc, out, root / f"{name}.log"

    return run


@pytest.fixture(scope="module")
def reference(launch_sh):
    rc, out, log = launch_sh("reference", "torchrun")
    assert rc == 0 and [r["step"] for r in read_metrics(out)] == list(range(1, STEPS + 1)), log.read_text()[-3000:]
    return read_metrics(out)


def _weights(ckpt, optimizer: bool = True) -> dict:
    """The module's parameters and, per rank, ZeRO's fp32 partition and Adam moments of a DeepSpeed checkpoint (its
    tag as `latest` names it: DeepSpeed's own step count, which after a rollback counts the steps applied)."""
    tag = ckpt / (ckpt / "latest").read_text().strip()
    tensors = dict(torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False, map_location="cpu")["module"])
    for rank in (0, 1) if optimizer else ():
        state = torch.load(tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", weights_only=False,
                           map_location="cpu")["optimizer_state_dict"]
        tensors[f"fp32.{rank}"] = state["single_partition_of_fp32_groups"][0]
        for index, moments in state["base_optimizer_state"]["state"].items():
            tensors.update({f"{name}.{rank}.{index}": moments[name] for name in ("exp_avg", "exp_avg_sq")})
    return tensors


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- a rank killed after a save: the job restarts by itself -----------------------------------------------------


@pytest.fixture(scope="module")
def restarted(launch_sh):
    killed = []

    # rank 1 is held at the start of step 3, so the kill lands after the save however fast the steps run. The kill
    # must come within ~HANG_TIMEOUT_S (10 s) of rank 0 blocking in step 3's first collective, or the watchdog ends
    # the job as a hang (incident 'hang', not 'failure'); it comes within a 50 ms poll and a ~0.1 s process scan of
    # `latest` naming checkpoint-2, about when rank 0 gets there: ~50x margin idle, and the poll and the scan, the
    # parts that slow with load, may take 5 s and still pass.
    rc, out, log = launch_sh("restarted", "torchrun", kill_rank_after_save("checkpoint-2", killed), SLOW_AT_3)
    return rc, out, log, killed


def test_a_killed_rank_restarts_the_job_from_the_last_checkpoint_and_it_ends_as_the_uninterrupted_run(restarted, reference):
    rc, out, log, killed = restarted
    assert killed and rc == 0, log.read_text()[-3000:]
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # each step once
    for step in range(3, STEPS + 1):  # the steps after the save, trained again after the restart
        assert {k: records[step - 1][k] for k in COMPARED} == {k: reference[step - 1][k] for k in COMPARED}, step
    failure, restart = read_incidents(out)
    assert failure["event"] == "failure" and [d["rank"] for d in failure["died"]] == [1]
    assert failure["died"][0]["pid"] == killed[0] and failure["latest"] == "checkpoint-2"
    assert restart["event"] == "restart" and restart["resume_from"] == "checkpoint-2"
    assert restart["attempt"]["torchrun"] == 1 and restart["cause"]["event"] == "failure"
    assert verify(resolve_latest(out)).ok


# ---- a rank frozen while a checkpoint is written ----------------------------------------------------------------


@pytest.fixture(scope="module")
def frozen(launch, recipe):
    """Rank 1 SIGSTOPs itself at step 4 once its checkpoint files are written, before the manifest."""
    return launch("frozen-in-save", "deepspeed", recipe, env={"DMT_FAULT": "stop@rank=1,step=4,phase=manifest"})


def test_a_frozen_rank_is_named_and_the_job_ends_with_code_3(frozen):
    assert frozen.rc == 3, frozen.tail()
    hang, collectives = read_incidents(frozen.out)
    [named] = hang["unresponsive"]
    # a frozen rank writes no flight recorder dump: torch's analysis covers rank 0's and says what it cannot decide
    assert collectives["event"] == "collectives" and collectives["dumps"] == [0], collectives
    assert collectives["analysis"], collectives
    assert (named["rank"], named["step"], named["phase"]) == (1, 4, "manifest"), hang
    assert named["pid"] and named["host"] and "no heartbeat" in named["reason"]
    assert named["ended_by_watchdog"] == "SIGKILL"  # the launcher need not wait its 30 s SIGTERM grace for it
    log = frozen.log.read_text()
    stopped_at = _log_time(log, "fault injection: stop on rank 1")
    reported_at = _log_time(log, "hang: rank 1")
    # rank 1 logs the fault, beats for 0.5 s more and stops; its heartbeat is then silent for HANG_TIMEOUT_S before
    # a monitor (period 0.5 s) names it: ~11 s idle, nearly all of it a wait on the monitor's clock, which load does
    # not lengthen. The bound, 40 s, leaves ~29 s for the parts load does slow (a delayed monitor thread, the
    # report's store reads and log line; under 1 s idle): ~30x.
    assert 0 < reported_at - stopped_at <= HANG_TIMEOUT_S + 30
    stacks = (frozen.out / hang["last_words"].split(str(frozen.out) + "/")[-1] / "rank0.stacks.txt").read_text()
    assert "on_save" in stacks  # rank 0 waited for rank 1 in the barrier before the manifest


def test_a_hang_during_a_save_leaves_latest_on_the_verified_checkpoint_before(frozen):
    assert resolve_latest(frozen.out).name == "checkpoint-2" and verify(resolve_latest(frozen.out)).ok
    interrupted = frozen.out / "checkpoint-4"
    assert (interrupted / "global_step4").is_dir() and not (interrupted / MANIFEST).exists()


def _log_time(log: str, text: str) -> float:
    import datetime

    line = next(line for line in log.splitlines() if text in line)
    return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


# ---- the guard --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def skipped(launch, variant):
    recipe = variant("tiny-guard-skip", training={**FAULTY, "save_steps": 1, "guard": {"on_nan": "skip"}})
    return launch("guard-skip", "deepspeed", recipe, env={"DMT_FAULT": "nan@step=3"})


def test_skip_drops_the_optimizer_step_of_a_nan_loss(skipped, reference):
    assert skipped.rc == 0, skipped.tail()
    records = read_metrics(skipped.out)
    assert records[2]["loss"] is None and records[2]["guard"][0]["action"] == "skip"
    assert all(r["loss"] is not None for r in records[3:])
    assert [{k: r[k] for k in COMPARED} for r in records[:2]] == [{k: r[k] for k in COMPARED} for r in reference[:2]]
    ckpt = {step: skipped.out / f"checkpoint-{step}" for step in (2, 3, 4)}
    assert _same(_weights(ckpt[2]), _weights(ckpt[3]))  # not one parameter or Adam moment moved at step 3
    assert not _same(_weights(ckpt[3]), _weights(ckpt[4]))
    [event] = read_incidents(skipped.out)
    assert (event["step"], event["action"], event["data_sha"]) == (3, "skip", records[2]["data_sha"])
    assert "the loss of step 3 is nan" in event["reason"]


@pytest.fixture(scope="module")
def rolled_back(launch, variant):
    guard = {"on_nan": "rollback", "spike_factor": 3, "window": 2}
    recipe = variant("tiny-guard-rollback", training={**FAULTY, "guard": guard})
    return launch("guard-rollback", "deepspeed", recipe, env={"DMT_FAULT": "spike=50@step=4"})


def test_rollback_reloads_the_last_checkpoint_and_goes_on_past_the_spike(rolled_back, reference):
    assert rolled_back.rc == 0, rolled_back.tail()
    [event] = read_incidents(rolled_back.out)
    assert (event["step"], event["action"], event["checkpoint"], event["dropped_steps"]) == \
           (4, "rollback", "checkpoint-2", [3, 4])
    assert event["loss"] > 3 * event["median"] and "above 3 x the median" in event["reason"]
    # checkpoint-4 was saved after the rollback: the model of checkpoint-2 (steps 3 and 4 dropped)
    assert _same(_weights(rolled_back.out / "checkpoint-2", False), _weights(rolled_back.out / "checkpoint-4", False))
    records = read_metrics(rolled_back.out)
    assert [r["data_sha"] for r in records] == [r["data_sha"] for r in reference]  # the data went on, not back
    assert records[4]["loss"] != reference[4]["loss"]  # step 5 trained from checkpoint-2's model
    assert verify(resolve_latest(rolled_back.out)).ok


def test_stop_saves_nothing_exits_4_and_is_not_restarted(launch_sh):
    rc, out, log = launch_sh("guard-stop", "deepspeed", fault="nan@step=3")
    assert rc == 4, log.read_text()[-3000:]
    assert "train.py: stopped by the guard: step 3: the loss of step 3 is nan" in log.read_text()
    assert "launch.sh: the job failed" not in log.read_text()  # launch.sh did not start it again
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    [event] = read_incidents(out)
    assert (event["event"], event["step"], event["action"]) == ("guard", 3, "stop")
