"""Ctrl-C, one line, and inputs read before they are used. A verb interrupted ends its children (whole process trees,
in sessions of their own), removes what it had half-made, and says so in one line with exit code 130; a refusal is
one line even where a library warns or a search finds nothing; the files a Slurm job will train with are read and
checked when the script is rendered, and submitting leaves no temporary script behind."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_fuzz_verbs import RECIPE_TEXT, _assert_refused, _run, _snapshot, sandbox  # noqa: F401 (a fixture)

from helpers import FUZZ_HANG_GUARD_S, ROOT
from toolkit.cli.main import main
from toolkit.errors import Interrupted

FSDP_TEXT = (ROOT / "recipes" / "tiny-llama-fsdp-cpu.yaml").read_text().replace(
    "data/tiny_corpus.txt", str(ROOT / "recipes" / "data" / "tiny_corpus.txt"))
VENV_BIN = Path(sys.executable).parent


def _gone(pids: list[int]) -> list[int]:
    """Of `pids`, the processes still running (a zombie has ended)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _in_sessions(sessions: set[int]) -> list[int]:
    """Every running process whose session is one of `sessions`."""
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) in sessions and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
        except (OSError, psutil.NoSuchProcess):
            pass
    return found


# ---- the mechanism: a step's children and what a command half-made ------------------------------------------------

def test_ctrl_c_ends_a_childs_whole_tree_even_the_part_in_a_session_of_its_own(tmp_path):
    """A launcher whose worker runs in a session of its own (as torchrun's do) and ignores SIGTERM: Ctrl-C in the
    command ends the launcher, the worker after the grace, and says how many it ended."""
    from toolkit.runtime.children import Children

    script = "trap '' TERM; setsid sh -c \"trap '' TERM; echo \\$\\$ > worker.pid; sleep 60\" & sleep 60; wait"
    with pytest.raises(KeyboardInterrupt) as caught:
        with Children("the test job", grace_s=0.5) as children:
            launcher = children.start(["sh", "-c", script], cwd=tmp_path)
            deadline = time.monotonic() + FUZZ_HANG_GUARD_S
            while not (tmp_path / "worker.pid").is_file() or not (tmp_path / "worker.pid").read_text().strip():
                assert time.monotonic() < deadline, "the worker never started"
                time.sleep(0.02)
            worker = int((tmp_path / "worker.pid").read_text())
            tree = [p.pid for p in psutil.Process(launcher.pid).children(recursive=True)] + [launcher.pid]
            os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, to this process only
            time.sleep(FUZZ_HANG_GUARD_S)  # the Ctrl-C ends it at once
    assert isinstance(caught.value, Interrupted) and caught.value.undone[0].startswith("ended the test job (")
    assert not _gone(tree + [worker]), "processes of the interrupted job still run"


def test_ctrl_c_while_a_child_starts_ends_it_too(tmp_path, monkeypatch):
    """The Ctrl-C lands inside Popen, after the fork and before Popen returns (Popen waits for the exec there): the
    interrupt is raised once the child is tracked, and the block's end ends it. Raised where it landed, it left the
    child running in a session of its own, out of the terminal's reach."""
    from toolkit.runtime import children as module

    started, popen = [], subprocess.Popen

    def popen_interrupted_inside(*args, **kwargs):
        process = popen(*args, **kwargs)
        started.append(process)
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, before Popen has returned
        time.sleep(0.5)  # Python runs the handler here, at the next bytecode
        return process

    monkeypatch.setattr(module.subprocess, "Popen", popen_interrupted_inside)
    with pytest.raises(KeyboardInterrupt) as caught:
        with module.Children("the test job", grace_s=0.5) as children:
            children.start(["sleep", "60"], cwd=tmp_path)
            time.sleep(FUZZ_HANG_GUARD_S)  # the Ctrl-C ends it at once
            pytest.fail("the Ctrl-C was lost")
    assert isinstance(caught.value, Interrupted) and caught.value.undone == ["ended the test job (1 process)"]
    assert started and started[0].poll() is not None, "the child started during the Ctrl-C still runs"


def test_an_interrupted_run_directory_goes_and_the_users_files_stay(tmp_path):
    from toolkit.outputs import removed_if_interrupted

    given = tmp_path / "given"
    given.mkdir()
    (given / "notes.txt").write_text("the user's\n")
    with pytest.raises(KeyboardInterrupt) as caught:
        with removed_if_interrupted(given):
            (given / "reference").mkdir()
            (given / "reference" / "metrics.jsonl").write_text("{}\n")
            (given / "reference.log").write_text("half a log\n")
            raise KeyboardInterrupt
    assert sorted(p.name for p in given.iterdir()) == ["notes.txt"]
    assert caught.value.undone == [f"removed reference, reference.log from {given}"]
    made = tmp_path / "made"
    with pytest.raises(KeyboardInterrupt) as caught:
        with removed_if_interrupted(made):
            made.mkdir()
            (made / "reference.log").write_text("half a log\n")
            raise KeyboardInterrupt
    assert not made.exists() and caught.value.undone == [f"removed {made}"]
    with pytest.raises(ValueError):  # any other failure keeps the logs that say why
        with removed_if_interrupted(made):
            made.mkdir()
            raise ValueError("a failed run")
    assert made.is_dir()


def test_an_interrupted_conversion_leaves_no_half_written_directory(tmp_path):
    from toolkit.checkpoint.atomic import atomic_directory

    out = tmp_path / "deep" / "hf"
    with pytest.raises(KeyboardInterrupt) as caught:
        with atomic_directory(out) as staging:
            (staging / "model-00001.safetensors").write_bytes(b"\0" * 64)
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))
    assert caught.value.undone == [f"removed what it had written of {out}"]


def test_ctrl_c_during_a_verb_is_one_line_and_exit_130(capsys, monkeypatch):
    """A real SIGINT to this process while `dmt plan` searches: the verb's answer is exit 130 and one line. The
    signal is sent as the search starts (an event, not a timer: the search may end within any fixed delay), and
    Python raises it in the search's own frames."""
    import toolkit.cli.plan as plan_verb

    real_search = plan_verb.search

    def search_interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return real_search(*args, **kwargs)

    monkeypatch.setattr(plan_verb, "search", search_interrupted)
    try:
        code = main(["plan", "--model", "llama-3.1-405b", "--gpus", "1024", "--seq-len", "4096", "--global-batch",
                     "4096"])
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped dmt")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 130 and err == ["dmt plan: interrupted"], (code, err)


# wandb makes two temporary directories when imported and leaves their removal to the interpreter's exit, which a rank
# ending by exit_now (every launch under train.py) or killed after Ctrl-C never reaches: a rank's way of importing it
_RANK_IMPORTING_WANDB = """
import os, signal, sys
from pathlib import Path
from toolkit.runtime.metrics import import_wandb_inside
from toolkit.runtime.watchdog import exit_now
how, run = sys.argv[1], Path(sys.argv[2])
if how == "plain import":
    import wandb
else:
    print(import_wandb_inside(run / "wandb"), flush=True)
if how == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
exit_now(0)
"""


@pytest.mark.parametrize("how", ["plain import", "exit_now", "killed"])
def test_a_rank_that_imported_wandb_leaves_no_temporary_directory_behind(tmp_path, how):
    """A rank imports wandb as configure_wandb does (import_wandb_inside: its import-time directories in one of its
    own inside the run's wandb directory) and ends by exit_now, as a completed or failed launch does: nothing of
    wandb's is left, neither in the temporary directory nor in the run's; killed (SIGKILL, nothing runs), what is left
    stays inside the run's directory. A plain import, as before, leaves two directories in the temporary one: the
    control that shows the check sees them."""
    temporary, run = tmp_path / "tmp", tmp_path / "run"
    temporary.mkdir()
    env = dict(os.environ, TMPDIR=str(temporary), PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    done = subprocess.run([sys.executable, "-c", _RANK_IMPORTING_WANDB, how, str(run)], env=env, capture_output=True,
                          text=True, timeout=FUZZ_HANG_GUARD_S)  # a hang guard, no verdict on speed
    left = sorted(p.name for p in temporary.iterdir() if "wandb" in p.name)
    inside = sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) if run.exists() else []
    if how == "plain import":
        assert done.returncode == 0 and len(left) == 2, (done.stderr[-2000:], left)
    elif how == "exit_now":
        assert done.returncode == 0 and not left and inside == ["wandb"], (done.stderr[-2000:], left, inside)
    else:
        assert done.returncode == -signal.SIGKILL and not left, (done.stderr[-2000:], left)
        mine = Path(done.stdout.split()[0])
        assert mine.parent == run / "wandb" and sorted(p.name.rsplit("wandb-", 1)[-1] for p in mine.iterdir()) == \
            ["artifacts", "media"], list(mine.iterdir())


# ---- one line means one line ---------------------------------------------------------------------------------------

MOE_TYPOS = [(["--ep", "3"], "--ep"), (["--ep", "16"], "--ep"), (["--tp", "3"], "--tp"), (["--pp", "5"], "--pp"),
             (["--vpp", "7"], "--vpp"), (["--backend", "fsdp", "--dp-shard", "7"], "--dp-shard")]


@pytest.mark.parametrize("flags, flag", MOE_TYPOS, ids=[" ".join(f) for f, _ in MOE_TYPOS])
def test_plan_with_an_option_no_layout_can_take_names_it(capsys, flags, flag):
    """Mixtral has 8 experts and 32 layers: --ep 3 is no typo of a valid plan, not an empty table with exit 1."""
    code, err = _run(capsys, ["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--seq-len", "4096",
                              "--global-batch", "512", "--json", *flags])
    _assert_refused(code, err, flag)
    assert len(err) == 1


def test_plan_where_nothing_fits_in_memory_is_still_an_answer(capsys):
    code = main(["plan", "--model", "llama-3.1-405b", "--gpus", "8", "--seq-len", "4096", "--global-batch", "8",
                 "--backends", "fsdp", "--offload-params", "none"])
    captured = capsys.readouterr()
    assert code == 1 and "0 fit" in captured.out and "out of memory" in captured.out and captured.err == ""


def test_train_py_refuses_an_unknown_flag_in_one_line():
    result = subprocess.run([sys.executable, "-m", "toolkit.train", "--recipee", "r.yaml"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "train.py: error: unrecognized arguments: --recipee r.yaml"], result.stderr


def test_accelerate_num_processes_as_text_is_named_as_text():
    from toolkit.validate.accelerate_fsdp import validate_accelerate_fsdp

    config = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}, "num_processes": "2"}
    problems = [str(p) for p in validate_accelerate_fsdp(config, 2) if p.key == "num_processes"]
    assert problems == ["num_processes: is '2', a str; write the integer 2 (the processes the job launches)"]


@pytest.mark.parametrize("host", ["no-such-host.invalid", "192.0.2.1", "127.0.0.1\0"])
def test_explore_names_the_host_not_the_port(capsys, host):
    code, err = _run(capsys, ["explore", "--host", host, "--port", "0"])
    _assert_refused(code, err, "--host")
    assert "--port" not in "\n".join(err)


# ---- inputs read before they are used ------------------------------------------------------------------------------

DEEPSPEED_FILES = {
    "missing": None,
    "truncated": '{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": ',
    "a list": "[1, 2]",
    "a wrong stage": '{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 7}}',
    "a batch for another world size": '{"train_batch_size": 3, "train_micro_batch_size_per_gpu": 1}',
}


@pytest.mark.parametrize("kind", sorted(DEEPSPEED_FILES))
def test_slurm_render_reads_the_deepspeed_json_it_is_given(sandbox, capsys, kind):  # noqa: F811
    ds = sandbox / "job-ds.json"
    if DEEPSPEED_FILES[kind] is not None:
        ds.write_text(DEEPSPEED_FILES[kind])
    before = _snapshot(sandbox)
    code, err = _run(capsys, ["slurm", "render", str(sandbox / "recipe.yaml"), "--deepspeed", str(ds)])
    _assert_refused(code, err, "--deepspeed", ds.name)
    assert _snapshot(sandbox) == before


def test_slurm_render_takes_a_valid_deepspeed_json(sandbox, capsys):  # noqa: F811
    assert main(["slurm", "render", str(sandbox / "recipe.yaml"), "--deepspeed", str(sandbox / "ds.json")]) == 0
    assert str(sandbox / "ds.json") in capsys.readouterr().out


ACCELERATE_FILES = {  # recipe backend, the file's text -> what the line must name
    "missing": ("fsdp", None, "accel.yaml"),
    "not yaml": ("fsdp", "key: [unclosed\n", "accel.yaml"),
    "a deepspeed json": ("fsdp", '{"train_micro_batch_size_per_gpu": 1}', "train_micro_batch_size_per_gpu"),
    "deepspeed's for fsdp": ("fsdp", "distributed_type: DEEPSPEED\nnum_processes: 2\n", "distributed_type"),
    "fsdp's for deepspeed": ("deepspeed", "distributed_type: FSDP\nnum_processes: 2\n", "distributed_type"),
    "another world size": ("fsdp", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\nnum_processes: 8\n",
                           "num_processes"),
}


@pytest.mark.parametrize("kind", sorted(ACCELERATE_FILES))
def test_slurm_render_checks_that_the_accelerate_config_is_one(sandbox, capsys, kind):  # noqa: F811
    backend, text, named = ACCELERATE_FILES[kind]
    recipe = sandbox / "recipe.yaml"
    if backend == "fsdp":
        recipe.write_text(FSDP_TEXT)
    accel = sandbox / "accel.yaml"
    if text is not None:
        accel.write_text(text)
    before = _snapshot(sandbox)
    code, err = _run(capsys, ["slurm", "render", str(recipe), "--launcher", "accelerate", "--accelerate-config",
                              str(accel)])
    _assert_refused(code, err, "--accelerate-config", named)
    assert _snapshot(sandbox) == before


def test_slurm_render_takes_the_accelerate_config_generate_wrote(sandbox, capsys):  # noqa: F811
    recipe = sandbox / "recipe.yaml"
    recipe.write_text(FSDP_TEXT)
    assert main(["generate", str(recipe), "--out", str(sandbox / "gen")]) == 0
    capsys.readouterr()
    assert main(["slurm", "render", str(recipe), "--launcher", "accelerate", "--accelerate-config",
                 str(sandbox / "gen" / "accelerate.yaml")]) == 0
    assert "accelerate launch --config_file" in capsys.readouterr().out


def _fake_sbatch(directory: Path, rc: int) -> Path:
    """An sbatch that keeps a copy of the script it was given (as sbatch does) and its path, then answers `rc`."""
    bin_dir = directory / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f'#!/bin/sh\nfor a; do last="$a"; done\necho "$last" > {directory}/given\n'
                      f'cp "$last" {directory}/copy.sbatch\n'
                      + ('echo "4242;cluster"\n' if rc == 0 else 'echo "sbatch: error: Invalid partition" >&2\n')
                      + f"exit {rc}\n")
    sbatch.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("rc", [0, 1], ids=["submitted", "refused by sbatch"])
def test_slurm_submit_leaves_no_temporary_script(sandbox, capsys, monkeypatch, rc):  # noqa: F811
    monkeypatch.setenv("PATH", f"{_fake_sbatch(sandbox, rc)}:{os.environ['PATH']}")
    code = main(["slurm", "submit", str(sandbox / "recipe.yaml"), "--output-dir", str(sandbox / "runs" / "job")])
    captured = capsys.readouterr()
    assert code == (0 if rc == 0 else 2), captured.err
    assert (captured.out.strip() == "4242") if rc == 0 else ("Invalid partition" in captured.err)
    given = Path((sandbox / "given").read_text().strip())
    assert given.suffix == ".sbatch" and not given.exists()
    assert "#SBATCH" in (sandbox / "copy.sbatch").read_text()


@pytest.mark.parametrize("recipe_text, launcher, backend", [(FSDP_TEXT, "deepspeed", "fsdp"),
                                                            (RECIPE_TEXT, "deepspeed", "megatron")],
                         ids=["fsdp", "megatron"])
def test_restore_test_refuses_a_launcher_the_backend_does_not_run_under(sandbox, capsys, recipe_text, launcher,
                                                                        backend):  # noqa: F811
    recipe = sandbox / "recipe.yaml"
    recipe.write_text(recipe_text)
    before = _snapshot(sandbox)
    argv = ["restore-test", "--recipe", str(recipe), "--workdir", str(sandbox / "restore"), "--launcher", launcher]
    code, err = _run(capsys, argv + (["--backend", backend] if backend == "megatron" else []))
    _assert_refused(code, err, "--launcher", f"the {backend} backend runs under torchrun")
    assert _snapshot(sandbox) == before


# ---- real launches, interrupted --------------------------------------------------------------------------------------

def _descendants(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _interrupt_when(argv: list[str], ready, timeout: float = 300) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Start `dmt ARGV`, wait until ready(its descendants) holds, send SIGINT to the dmt process alone (a terminal's
    Ctrl-C would reach only it: its children run in sessions of their own); its result and the descendants it had.
    `timeout` and the 120 s for the exit are hang guards, no verdict: ranks start within ~5 s, a training launch's
    within ~70 s at load ~10 on 2 cores (300 s is 4x), and an interrupted job exits within seconds."""
    process = subprocess.Popen([sys.executable, "-m", "toolkit", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    try:
        while not ready(tree := _descendants(process.pid)):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, f"not ready after {timeout} s"
            time.sleep(0.2)
        pids = [p.pid for p in tree]
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    return subprocess.CompletedProcess(argv, process.returncode, out, err), pids


def _ranks_training(tree: list) -> bool:
    """Both ranks of toolkit/train.py are running (`python -u -m toolkit.train`, as deepspeed and torchrun start them),
    not only their launchers."""
    ranks = 0
    for process in tree:
        try:
            cmd = process.cmdline()
        except psutil.NoSuchProcess:
            continue
        ranks += cmd[1:4] == ["-u", "-m", "toolkit.train"]
    return ranks >= 2


@pytest.mark.launch
@pytest.mark.parametrize("recipe_text, launcher", [(RECIPE_TEXT, "deepspeed"), (FSDP_TEXT, "torchrun")],
                         ids=["deepspeed", "fsdp-torchrun"])
def test_ctrl_c_on_restore_test_ends_its_training_and_removes_its_workdir(tmp_path, recipe_text, launcher):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_text)
    workdir = tmp_path / "restore"
    result, pids = _interrupt_when(["restore-test", "--recipe", str(recipe), "--steps", "6", "--workdir",
                                    str(workdir)], _ranks_training)
    lines = result.stderr.splitlines()
    assert result.returncode == 130 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("dmt restore-test: interrupted; ended the reference run's training (")
    assert lines[0].endswith(f"removed {workdir}")
    sessions = set()
    for pid in pids:
        try:
            sessions.add(os.getsid(pid))
        except OSError:
            pass
    assert not _gone(pids) and not _in_sessions(sessions - {os.getsid(0)}), "training processes were left running"
    assert not workdir.exists()


def _both_health_ranks(tree: list) -> bool:
    """Both rank processes (`python -m toolkit.health.worker`) have started, not one rank and something it runs
    (a rank's own short-lived subprocess made two descendants before the second rank existed: 1 process ended)."""
    ranks = 0
    for process in tree:
        try:
            ranks += "toolkit.health.worker" in process.cmdline()
        except psutil.NoSuchProcess:
            continue
    return ranks >= 2


@pytest.mark.launch
def test_ctrl_c_on_health_ends_its_ranks(tmp_path):
    result, pids = _interrupt_when(["health", "--nproc", "2", "--matmul-seconds", "60", "--deadline-s", "120"],
                                   _both_health_ranks, timeout=120)
    assert result.returncode == 130, result.stderr
    assert result.stderr.splitlines() == ["dmt health: interrupted; ended the 2 health-check ranks (2 processes)"]
    assert not _gone(pids)


@pytest.mark.launch
def test_megatron_cores_warnings_do_not_come_before_a_refusal(tmp_path):
    """A fresh interpreter (Megatron-Core warns once a process, on import): an HF directory with a tensor missing is
    refused by hf-to-megatron, after the Megatron-Core model is built, in one line."""
    import torch
    from safetensors.torch import save_file

    from helpers import tiny_llama_config

    hf = tmp_path / "hf"
    hf.mkdir()
    config = tiny_llama_config()
    (hf / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(config["vocab_size"], config["hidden_size"])},
              str(hf / "model.safetensors"))
    result = subprocess.run([sys.executable, "-m", "toolkit", "convert", "hf-to-megatron", str(hf),
                             str(tmp_path / "mcore")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"dmt convert: error: HF_DIR: tensor model.layers.0.self_attn.q_proj.weight "
                                          f"is missing from {hf}"]
