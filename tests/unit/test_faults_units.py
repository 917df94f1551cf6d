"""The fault-tolerance pieces on their own (no launch): the guard's verdicts, fault injection, incident.json and the
reason of a restart, metrics.jsonl after a resume, the checkpoint a restart continues from, the recipe keys, the
restart loop of launch.sh, and a worker's one-line error."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import TINY
from toolkit.checkpoint.manifest import latest_verified, point_latest, write_manifest
from toolkit.cli.main import main
from toolkit.errors import UserInputError, worker_error
from toolkit.runtime import faults
from toolkit.runtime.guard import GuardStop, LossGuard, record_verdict
from toolkit.runtime.incident import append_incident, read_incidents, restart_counts
from toolkit.runtime.metrics import DISCARDED_FILE, MetricsWriter, keep_until, read_metrics
from toolkit.runtime.supervision import kill_later, record_restart, where
from toolkit.spec.recipe import load_recipe


def test_the_guard_stops_skips_or_rolls_back_on_a_non_finite_loss_or_gradient():
    guard = LossGuard(on_nan="skip")
    assert guard.judge(1, 5.0).action is None
    verdict = guard.judge(2, math.nan)
    assert verdict.action == "skip" and "step 2" in verdict.reason and verdict.loss is None
    assert guard.judge(3, 5.0, grad_norm=math.inf).action == "skip"
    assert LossGuard().judge(4, math.inf).action == "stop"  # the default


def test_a_spike_is_judged_against_the_median_of_the_window_once_it_is_full():
    guard = LossGuard(on_nan="rollback", spike_factor=3, window=3)
    for step, loss in enumerate((4.0, 100.0), start=1):  # the window is not full: no spike rule yet
        assert guard.judge(step, loss).action is None
        guard.accept(step, loss)
    guard.accept(3, 3.0)
    verdict = guard.judge(4, 13.0)  # median(4, 100, 3) = 4; 13 > 3 x 4
    assert verdict.action == "rollback" and verdict.median == 4.0 and "13" in verdict.reason
    assert guard.judge(4, 11.9).action is None
    guard.accept(4, 5.0)
    assert guard.state() == [(2, 100.0), (3, 3.0), (4, 5.0)]  # the last `window` applied steps only


def test_rollbacks_to_one_checkpoint_are_capped(tmp_path):
    guard = LossGuard(on_nan="rollback")
    for _ in range(3):
        guard.rolled_back_to(tmp_path / "checkpoint-4", [(4, 2.0)])
    assert guard.history == [(4, 2.0)]
    with pytest.raises(GuardStop, match="checkpoint-4 3 times"):
        guard.rolled_back_to(tmp_path / "checkpoint-4", [])


def test_a_stop_is_reported_by_rank_0_and_raised_on_every_rank(tmp_path):
    verdict = LossGuard().judge(7, math.nan)
    for rank in (1, 0):
        with pytest.raises(GuardStop, match="step 7"):
            record_verdict(tmp_path, rank, 7, verdict, "abc")
    events = read_incidents(tmp_path)
    assert len(events) == 1 and events[0]["event"] == "guard" and events[0]["step"] == 7
    assert events[0]["action"] == "stop" and events[0]["data_sha"] == "abc"


def test_faults_are_parsed_and_only_the_first_launch_acts_them_out(monkeypatch):
    parsed = faults.parse_faults("nan@step=5; spike=50@step=6;stop@rank=1,step=4,phase=manifest")
    assert [(f.kind, f.step, f.rank, f.phase) for f in parsed] == [("nan", 5, None, None), ("spike", 6, None, None),
                                                                   ("stop", 4, 1, "manifest")]
    assert parsed[1].factor == 50
    monkeypatch.setenv(faults.FAULT_ENV, "nan@step=5;spike=50@step=6")
    assert math.isnan(faults.loss_factor(5)) and faults.loss_factor(6) == 50 and faults.loss_factor(7) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert faults.loss_factor(5) is None


def test_a_slow_rank_goes_on_once_the_save_and_exit_request_is_there(tmp_path, monkeypatch):
    """A step held open (slow=30) ends when a scheduler's request arrives, not 30 s later: the request is acted on
    at the end of that step. Without the request the hold lasts its time."""
    import threading
    import time

    from toolkit.runtime.incident import RESTART_COUNTERS

    for counter in RESTART_COUNTERS.values():
        monkeypatch.delenv(counter, raising=False)
    monkeypatch.setenv(faults.FAULT_ENV, "slow=30@step=21,phase=train;slow=1@step=22,phase=train")
    request = tmp_path / "SAVE_AND_EXIT"
    threading.Timer(0.3, request.touch).start()
    start = time.monotonic()
    faults.at_phase(21, "train", 0, wake=request)
    # woken by the request (the timer fires at 0.3 s): the 30 s hold was cut short. Both bounds are the code's own:
    # it cannot return before the request exists, and only a missed wake-up would sleep the whole 30 s.
    assert 0.3 <= time.monotonic() - start < 30
    request.unlink()
    start = time.monotonic()
    faults.at_phase(22, "train", 0, wake=request)
    assert time.monotonic() - start >= 1


def test_a_restart_records_what_ended_the_previous_attempt(tmp_path, monkeypatch):
    for name in ("TORCHELASTIC_RESTART_COUNT", "DMT_RESTART_COUNT", "SLURM_RESTART_COUNT", "RANK"):
        monkeypatch.delenv(name, raising=False)
    record_restart(tmp_path, None)  # a first launch records nothing
    assert read_incidents(tmp_path) == []
    append_incident(tmp_path, {"event": "hang", "unresponsive": [{"rank": 1}]})
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    record_restart(tmp_path, "checkpoint-4")
    restart = read_incidents(tmp_path)[-1]
    assert restart["event"] == "restart" and restart["resume_from"] == "checkpoint-4"
    assert restart["cause"]["event"] == "hang" and restart["attempt"] == restart_counts()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # attempt 1 ended without a word (SIGKILL)
    record_restart(tmp_path, "checkpoint-4")
    assert "without a report" in read_incidents(tmp_path)[-1]["cause"]


def test_a_run_the_guard_stopped_is_not_restarted(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with pytest.raises(GuardStop):
        record_verdict(tmp_path, 0, 3, LossGuard().judge(3, math.nan), None)
    monkeypatch.setenv("DMT_RESTART_COUNT", "1")
    with pytest.raises(GuardStop, match="not restarting: the guard stopped this run at step 3"):
        record_restart(tmp_path, "checkpoint-2")


def test_a_resume_moves_the_records_of_later_steps_aside(tmp_path):
    writer = MetricsWriter(tmp_path, 64)
    for step in range(1, 6):
        writer.write(step, float(step), math.inf, 0.1)
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 6, "lo')  # the writer was killed mid-line
    assert read_metrics(tmp_path)[0]["grad_norm"] is None  # non-finite values are null: strict JSON
    keep_until(tmp_path, 3)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("}\n")
    discarded = [json.loads(line)["step"] for line in (tmp_path / DISCARDED_FILE).read_text().splitlines()]
    assert discarded == [4, 5]


def _checkpoint(root: Path, step: int) -> Path:
    ckpt = root / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "weights.bin").write_bytes(b"x" * 100)
    write_manifest(ckpt, step=step, world_size=1, layout={}, fmt="test")
    point_latest(root, ckpt)
    return ckpt


def test_a_restart_continues_from_the_newest_checkpoint_that_is_whole(tmp_path):
    assert latest_verified(tmp_path) is None
    older, newer = _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4)
    (tmp_path / "checkpoint-6").mkdir()  # a save in progress: no manifest
    assert latest_verified(tmp_path) == newer
    (newer / "weights.bin").write_bytes(b"x" * 10)  # truncated after the fact
    assert latest_verified(tmp_path) == older


def test_fault_tolerance_keys_have_defaults_and_name_what_is_wrong(tmp_path, capsys):
    recipe = load_recipe(TINY)
    assert (recipe.training.hang_timeout_s, recipe.training.max_restarts, recipe.training.guard.on_nan,
            recipe.training.guard.spike_factor) == (600.0, 3, "stop", 0.0)
    data = yaml.safe_load(TINY.read_text())
    for guard, says in (({"spike_factor": 0.5}, "training.guard.spike_factor: must be 0 (off) or above 1"),
                        ({"on_nan": "ignore"}, "training.guard.on_nan: got 'ignore'; valid:"),
                        ({"windw": 3}, "training.guard.windw: unknown key; valid keys here: on_nan, spike_factor")):
        data["training"]["guard"] = guard
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(data))
        assert main(["generate", str(path), "--out", str(tmp_path / "gen")]) == 2
        assert says in capsys.readouterr().err


def _generated_launch(tmp_path: Path, max_restarts: int) -> Path:
    data = yaml.safe_load(TINY.read_text())
    data["data"]["train_files"] = [str(TINY.parent / f) for f in data["data"]["train_files"]]
    data["training"]["max_restarts"] = max_restarts
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    assert main(["generate", str(recipe), "--out", str(tmp_path / "gen")]) == 0
    return tmp_path / "gen" / "launch.sh"


def test_launch_sh_restarts_a_failed_launch_up_to_max_restarts_and_never_after_bad_input_or_a_guard_stop(tmp_path):
    """A fake `deepspeed` fails with the codes it is given, one per launch, and records each launch's
    DMT_RESTART_COUNT; torchrun gets its own --max-restarts with the c10d rendezvous."""
    script = _generated_launch(tmp_path, 2)
    text = script.read_text()
    assert "MAX_RESTARTS=2" in text and 'exec torchrun --max-restarts "$MAX_RESTARTS" --rdzv-backend c10d' in text
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "deepspeed").write_text(f"#!{sys.executable}\nimport os, sys\n"
                                    "log = os.environ['FAKE_LOG']; codes = os.environ['FAKE_CODES'].split(',')\n"
                                    "n = len(open(log).readlines()) if os.path.exists(log) else 0\n"
                                    "open(log, 'a').write(os.environ.get('DMT_RESTART_COUNT', '-') + '\\n')\n"
                                    "sys.exit(int(codes[n]))\n")
    (fake / "deepspeed").chmod(0o755)
    for codes, rc, launches in (("1,3,0", 0, ["0", "1", "2"]), ("1,1,1,0", 1, ["0", "1", "2"]),
                                ("4,0", 4, ["0"]), ("3,2,0", 2, ["0", "1"])):
        log = tmp_path / f"launches-{codes}.txt"
        env = dict(os.environ, PATH=f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}", FAKE_LOG=str(log),
                   FAKE_CODES=codes, OUTPUT_DIR=str(tmp_path / "run"))
        result = subprocess.run(["bash", str(script), "deepspeed"], env=env, capture_output=True, text=True)
        assert result.returncode == rc, (codes, result.stderr)
        assert log.read_text().split() == launches, codes
    assert "restart 2 of 2" in subprocess.run(
        ["bash", str(script), "deepspeed"], capture_output=True, text=True,
        env=dict(env, FAKE_LOG=str(tmp_path / "again.txt"), FAKE_CODES="1,1,0")).stderr


def test_a_workers_one_line_error_becomes_the_commands_own():
    log = "noise\n[rank1]: Traceback ...\ntrain.py: error: model.config.vocab_size: 300 < tokenizer size 512\nmore noise\n"
    error = worker_error(log, "the reference run; log: /tmp/x.log")
    assert str(error) == ("model.config.vocab_size: 300 < tokenizer size 512 (the reference run; log: /tmp/x.log)")
    assert worker_error("train.py: stopped by the guard: step 3: the loss of step 3 is nan", "w").key == "step 3"
    assert worker_error("dmt health: error: MASTER_ADDR: cannot listen", "rank 1").key == "MASTER_ADDR"
    assert worker_error("Traceback (most recent call last):\nRuntimeError: boom\n", "w") is None


def test_a_heartbeats_step_name_reads_as_step_and_phase():
    assert where("step 12 manifest") == (12, "manifest") and where("step 3 forward-backward") == (3, "forward-backward")
    assert where("start") == (None, "start") and where(None) == (None, None)


def test_a_stopped_process_is_killed_after_the_delay_by_a_helper_that_outlives_the_caller():
    """kill_later: a SIGSTOPped process (it would never act on a launcher's SIGTERM) ends with SIGKILL, not before
    the delay (the launcher must see the reporter's own exit code first)."""
    import signal
    import time

    victim = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(victim.pid, signal.SIGSTOP)
        # not before its delay, whatever the machine's load: the kill comes at least 2 s after it was asked for (the
        # code's own guarantee; a fixed look at "not yet" would race the test's own wake-up). 30 s bounds a hang.
        asked = time.monotonic()
        kill_later([victim.pid], 2.0)
        assert victim.wait(timeout=30) == -signal.SIGKILL
        assert time.monotonic() - asked >= 2.0
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()


def test_a_launcher_sigterm_during_a_failure_report_does_not_cut_it_short(tmp_path, monkeypatch):
    """torchrun SIGTERMs the surviving ranks as soon as it sees one die, about when the survivor's collective raises:
    the SIGTERM arriving while the failure is printed must not replace the failure (no report, no exit hooks: a
    background write's bounded wait never ran, CI 2026-11-26). Here the print itself brings the SIGTERM."""
    import signal
    import threading
    import traceback
    from types import SimpleNamespace

    from toolkit.runtime import supervision
    from toolkit.runtime.supervision import TrainingWatchdog
    from toolkit.runtime.watchdog import LauncherTerminated, raise_terminated

    class Exited(Exception):
        pass

    def exit_now(code):
        raise Exited(code)

    def sigterm_while_printing(exc):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at the next bytecode of this thread

    watch = TrainingWatchdog(tmp_path, hang_timeout_s=10)
    watch.env = SimpleNamespace(host="node-0", rank=1, world_size=2)
    watch.watchdog = SimpleNamespace(
        tripped=threading.Event(), claim_report=lambda: True, silent_ranks=lambda within: [0], store=None,
        read_beats=lambda store: {}, hosts=lambda store: ["node-0", "node-0"], world=2, step_name="step 5 train",
        report_written=lambda: None, mark_exit=lambda: None)
    hooks = []
    watch.before_exit(lambda: hooks.append("abandon"))
    monkeypatch.setattr(supervision, "exit_now", exit_now)
    monkeypatch.setattr(traceback, "print_exception", sigterm_while_printing)
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        with pytest.raises(Exited) as exited:
            watch.fail(RuntimeError("Connection closed by peer"), before_exit=lambda: hooks.append("ended"))
        # and the same SIGTERM at the first line of the caller's handler (toolkit/train.py shields first)
        signal.signal(signal.SIGTERM, raise_terminated)
        try:
            raise RuntimeError("gloo: Connection reset by peer")
        except RuntimeError:
            watch.shield()
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(10))  # bytecodes after the signal: an unshielded handler would raise here
    except LauncherTerminated:
        pytest.fail("the launcher's SIGTERM replaced the failure being reported")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exited.value.args == (supervision.EXIT_FAILURE,)
    [failure] = read_incidents(tmp_path)
    assert failure["event"] == "failure" and "Connection closed by peer" in failure["reason"]
    assert [d["rank"] for d in failure["died"]] == [0]
    assert hooks == ["ended", "abandon"]


def test_in_process_restart_is_refused_where_it_cannot_run_and_its_launcher_starts_ranks_and_spares(tmp_path, capsys):
    """training.restart: in_process: a DeepSpeed recipe is refused in one line naming the key, the backends that
    take it and why DeepSpeed does not; a Megatron-Core one gets launch.sh's `inprocess` launcher as the default, starting cluster.gpus ranks
    and training.spare_ranks spares as processes of their own (no torchrun agent to end the survivors)."""
    data = yaml.safe_load(TINY.read_text())
    data["data"]["train_files"] = [str(TINY.parent / f) for f in data["data"]["train_files"]]
    data["training"]["restart"] = "in_process"
    path = tmp_path / "deepspeed.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["generate", str(path), "--out", str(tmp_path / "ds")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "training.restart" in err and "Megatron-Core or FSDP2" in err, err
    assert "deepspeed.utils.groups" in err, err
    megatron = Path(__file__).resolve().parents[2] / "recipes" / "tiny-llama-megatron-cpu.yaml"
    data = yaml.safe_load(megatron.read_text())
    data["data"]["train_files"] = [str(megatron.parent / f) for f in data["data"]["train_files"]]
    data["training"].update(restart="in_process", spare_ranks=2)
    path = tmp_path / "megatron.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["generate", str(path), "--out", str(tmp_path / "mc")]) == 0
    text = (tmp_path / "mc" / "launch.sh").read_text()
    assert 'LAUNCHER="${1:-inprocess}"' in text and "WORLD=$((2 + 2))" in text and "DMT_SPARE_RANKS=2" in text
    assert "Usage: launch.sh [inprocess|torchrun|ft_launcher]" in text


def test_ft_launcher_is_a_launcher_with_its_config_from_the_recipe_read_by_nvrx_own_config_class(tmp_path, capsys,
                                                                                                  monkeypatch):
    """Wherever torchrun runs a plan, launch.sh offers NVRx's ft_launcher with the generated ft_config.yaml; its
    timeouts come from training.hang_timeout_s and NVRx's FaultToleranceConfig reads it (`dmt validate`, and every
    read of the generated directory); a key NVRx does not know, a signal it has not, a negative timeout: one line,
    exit 2."""
    from nvidia_resiliency_ext.fault_tolerance import FaultToleranceConfig

    script = _generated_launch(tmp_path, 2)
    text = script.read_text()
    assert "Usage: launch.sh [deepspeed|accelerate|torchrun|ft_launcher]" in text
    assert ('exec ft_launcher --ft-cfg-path "$HERE/ft_config.yaml" \\\n      --ft-enable-nic-monitor false \\\n'
            '      --max-restarts "$MAX_RESTARTS" '
            '--rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$MASTER_PORT"') in text
    config_path = script.parent / "ft_config.yaml"
    hang = load_recipe(tmp_path / "recipe.yaml").training.hang_timeout_s
    config = FaultToleranceConfig.from_yaml_file(str(config_path), ignore_not_recognized=False)
    assert config.rank_heartbeat_timeout == hang and config.initial_rank_heartbeat_timeout == 2 * hang
    assert config.rank_section_timeouts == {"step": hang, "checkpointing": hang}  # until NVRx calculates them
    assert config.rank_out_of_section_timeout == hang
    assert config.enable_nic_monitor is False  # a CPU recipe: no NICs for NVRx's NIC monitor to map
    assert main(["validate", str(config_path)]) == 0
    assert "valid (NVRx's FaultToleranceConfig" in capsys.readouterr().out
    sbatch = tmp_path / "ft.sbatch"  # the Slurm script: one ft_launcher per node with the generated directory's file
    assert main(["slurm", "render", str(tmp_path / "recipe.yaml"), "--plan", str(script.parent), "--launcher",
                 "ft_launcher", "--out", str(sbatch)]) == 0
    assert (f"exec ft_launcher --ft-cfg-path={config_path} --ft-enable-nic-monitor=false "
            "--nnodes=$SLURM_NNODES") in sbatch.read_text()  # the command line's NIC default would beat the file's
    assert main(["slurm", "render", str(tmp_path / "recipe.yaml"), "--launcher", "ft_launcher"]) == 2
    assert "--launcher: ft_launcher reads the ft_config.yaml" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)  # the Kubernetes manifests: the image holds this directory at /workspace
    ft = "ft_launcher --ft-cfg-path gen/ft_config.yaml --ft-enable-nic-monitor false -m toolkit.train"
    for kind, command in (("jobset", ft), ("pytorchjob", f'exec {ft} "$@"')):
        manifest = tmp_path / f"{kind}.yaml"
        assert main(["k8s", "render", "recipe.yaml", "--plan", "gen", "--kind", kind, "--image", "reg.io/dmt:1",
                     "--launcher", "ft_launcher", "--out", str(manifest)]) == 0
        (document,) = yaml.safe_load_all(manifest.read_text())
        text = json.dumps(document)
        words = command.split() if kind == "jobset" else [json.dumps(command)[1:-1]]  # a list, or one bash -c line
        assert all(word in text for word in words), text[-1500:]
        assert main(["validate", str(manifest)]) == 0
    original = yaml.safe_load(config_path.read_text())
    for change, says in (({"rank_heartbeat_timeot": 5}, "Not recognized args"),
                         ({"rank_termination_signal": "SIGNOPE"}, "rank_termination_signal"),
                         ({"rank_heartbeat_timeout": -1}, "fault_tolerance.rank_heartbeat_timeout: must be a positive")):
        edited = {"fault_tolerance": {**original["fault_tolerance"], **change}}
        config_path.write_text(yaml.safe_dump(edited))
        assert main(["validate", str(config_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, err
    with pytest.raises(UserInputError, match="must be a positive"):  # the generated directory's own read refuses it too
        from toolkit.validate.generated import read_generated
        read_generated(script.parent / "plan.json")


def test_nvrx_calculated_timeouts_are_kept_within_the_recipes_bounds():
    """NVRx's own calculation (TimeoutsCalc, fed observed intervals; what RankMonitorClient.calculate_and_set_*
    sends) put through ftmonitor.bounded: a calculated timeout below a quarter of hang_timeout_s is raised to it, one
    above hang_timeout_s lowered to it, one in between kept; the first heartbeat's and the out-of-section timeouts
    stay as ft_config.yaml says; the result is a state NVRx's client loads."""
    import dataclasses

    from nvidia_resiliency_ext.fault_tolerance.data import HeartbeatTimeouts, SectionAction, SectionTimeouts
    from nvidia_resiliency_ext.fault_tolerance.rank_monitor_client import RankMonitorClient
    from nvidia_resiliency_ext.fault_tolerance.timeouts_calc import TimeoutsCalc

    from toolkit.generate.ft_launcher import SECTIONS, fault_tolerance_timeouts
    from toolkit.runtime.ftmonitor import STATE_KEY, bounded

    hang = 100.0
    calc = TimeoutsCalc(sections=SECTIONS, start_time=0.0, safety_factor=5.0)
    for at in (1.0, 2.0, 3.0, 33.0):  # the longest interval between heartbeats: 30 s -> 150 s calculated
        calc.update_on_heartbeat(hb_time=at)
    calc.update_on_section_event("step", SectionAction.OPEN, event_time=40.0)
    calc.update_on_section_event("step", SectionAction.CLOSE, event_time=41.0)  # 1 s -> 5 s
    calc.update_on_section_event("checkpointing", SectionAction.OPEN, event_time=41.0)
    calc.update_on_section_event("checkpointing", SectionAction.CLOSE, event_time=51.0)  # 10 s -> 50 s
    configured = fault_tolerance_timeouts(hang)
    current = SectionTimeouts(section=configured["rank_section_timeouts"],
                              out_of_section=configured["rank_out_of_section_timeout"], calculated_sections={},
                              is_out_of_section_calculated=False)
    state = {STATE_KEY: {
        "heartbeat": dataclasses.asdict(calc.get_hb_timeouts()),
        "section": {**dataclasses.asdict(calc.get_section_timeouts(SECTIONS, False, current)),
                    "calculated_sections": sorted(SECTIONS)}}}
    assert state[STATE_KEY]["heartbeat"]["subsequent"] == 150.0
    kept = bounded(state, hang)[STATE_KEY]
    assert kept["heartbeat"] == {"initial": 2 * hang, "subsequent": hang, "were_calculated": True}
    assert kept["section"]["section"] == {"step": hang / 4, "checkpointing": 50.0}
    assert kept["section"]["out_of_section"] == hang and not kept["section"]["is_out_of_section_calculated"]
    client = RankMonitorClient()
    client.load_state_dict(bounded(state, hang))  # NVRx's own loader takes it (before its monitor connection)
    assert client.loaded_hb_timeouts == HeartbeatTimeouts(initial=2 * hang, subsequent=hang, were_calculated=True)


def test_local_checkpoints_are_refused_where_nvrx_cannot_take_them(tmp_path, capsys):
    """checkpoint.local: a DeepSpeed recipe is refused in one line naming the key and the backend that takes it;
    replication > 1 on CPU ranks in one line naming checkpoint.local.replication and NVRx 0.4.1's CUDA receive
    buffer; replication 1 on the Megatron-Core CPU recipe generates."""
    data = yaml.safe_load(TINY.read_text())
    data["data"]["train_files"] = [str(TINY.parent / f) for f in data["data"]["train_files"]]
    data["checkpoint"] = {"local": {"dir": "local"}}
    path = tmp_path / "deepspeed.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["generate", str(path), "--out", str(tmp_path / "ds")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "checkpoint.local" in err and "Megatron-Core" in err, err
    megatron = Path(__file__).resolve().parents[2] / "recipes" / "tiny-llama-megatron-cpu.yaml"
    data = yaml.safe_load(megatron.read_text())
    data["data"]["train_files"] = [str(megatron.parent / f) for f in data["data"]["train_files"]]
    data["checkpoint"] = {"local": {"dir": "local", "every": 1, "replication": 2}}
    path = tmp_path / "megatron.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["generate", str(path), "--out", str(tmp_path / "mc2")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "checkpoint.local.replication" in err and "CUDA buffer" in err, err
    data["checkpoint"]["local"]["replication"] = 1
    path.write_text(yaml.safe_dump(data))
    assert main(["generate", str(path), "--out", str(tmp_path / "mc1")]) == 0
