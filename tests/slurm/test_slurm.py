"""Generated SLURM scripts: multi-node rendering checked against Slurm's own variables, and real jobs on a real Slurm."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, TINY
from toolkit.checkpoint.manifest import resolve_latest
from toolkit.cli.main import main
from toolkit.runtime.metrics import read_metrics


def _recipe(tmp_path: Path, gpus: int, gpus_per_node: int = 8, **training) -> Path:
    text = TINY.read_text().replace("gpus: 2\n  gpus_per_node: 2", f"gpus: {gpus}\n  gpus_per_node: {gpus_per_node}")
    text = text.replace("data/tiny_corpus.txt", str(ROOT / "recipes/data/tiny_corpus.txt"))
    for key, value in training.items():
        text = "\n".join(f"  {key}: {value}" if line.startswith(f"  {key}:") else line for line in text.splitlines()) + "\n"
    path = tmp_path / f"recipe-{gpus}.yaml"
    path.write_text(text)
    return path


def _fake_bin(tmp_path: Path) -> Path:
    """`srun` that runs its command once per node with that node's SLURM_NODEID; launchers that print their args."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                                  'for ((n = 0; n < SLURM_NNODES; n++)); do SLURM_NODEID=$n "$@"; done\n')
    for tool in LAUNCH_CHECKS:
        (bin_dir / tool).write_text(f'#!/usr/bin/env bash\necho "{tool} $*"\n')
    for tool in ("srun", *LAUNCH_CHECKS):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


# launcher -> what every node's command line must hold, for node index {node} of {nodes} (8 GPUs each)
LAUNCH_CHECKS = {
    # torchrun's c10d rendezvous at node 0 assigns the node ranks (and serves its restarts)
    "torchrun": ("--nnodes={nodes}", "--nproc_per_node=8", "--max-restarts=3", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=gpu001:{port}", "--rdzv-id=123456"),
    "accelerate": ("launch --config_file", "--num_machines={nodes}", "--machine_rank={node}",
                   "--num_processes={world}", "--main_process_ip=gpu001 --main_process_port={port}"),
    "deepspeed": ("--no_ssh", "--num_nodes={nodes}", "--node_rank={node}", "--num_gpus=8",
                  "--master_addr=gpu001 --master_port={port}"),
}


@pytest.mark.parametrize("launcher, nodes", [("torchrun", 2), ("torchrun", 4), ("torchrun", 16), ("torchrun", 64),
                                             ("accelerate", 2), ("accelerate", 16), ("deepspeed", 2),
                                             ("deepspeed", 16)])
def test_multi_node_rendezvous_as_slurm_would_set_it(tmp_path, capsys, launcher, nodes):
    if shutil.which("scontrol") is None:  # without it the script's rendezvous host is empty
        pytest.skip("needs Slurm's scontrol for the node list's expansion (.ci/run installs slurm-wlm)")
    recipe = _recipe(tmp_path, nodes * 8, global_batch=1024)
    recipe.write_text(recipe.read_text().replace("micro_batch: 4", "micro_batch: 1"))
    flags = ["--launcher", launcher]
    if launcher == "accelerate":  # the accelerate.yaml `dmt generate` writes for this recipe (render reads it)
        assert main(["generate", str(recipe), "--out", str(tmp_path / "gen")]) == 0
        capsys.readouterr()
        flags += ["--accelerate-config", str(tmp_path / "gen" / "accelerate.yaml")]
    assert main(["slurm", "render", str(recipe), "--partition", "gpu", "--time", "2-00:00:00", *flags]) == 0
    script = capsys.readouterr().out
    assert f"#SBATCH --nodes={nodes}" in script and "#SBATCH --ntasks-per-node=1" in script
    assert "--ntasks=$((SLURM_NNODES * 8)) --ntasks-per-node=8" in script  # the preflight: one task per GPU
    assert "LOCAL_WORLD_SIZE=8 exec python -m toolkit health" in script  # its GPU-count check knows the ranks per node
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --requeue" in script and "--signal=B:USR1@" in script
    # run the script's rendezvous and launch lines with the variables Slurm sets for this allocation
    body = script.split("trap requeue USR1", 1)[1].split("# Preflight", 1)[0]
    launch = script.split("rm -f \"$OUTPUT_DIR/SAVE_AND_EXIT\"", 1)[1].replace("&\nTRAIN_PID=$!\nwait \"$TRAIN_PID\"", "")
    head = script.split("set -euo pipefail", 1)[1].split("requeue() {", 1)[0]
    harness = tmp_path / "harness.sh"
    fake = _fake_bin(tmp_path)  # ahead of the Python environment the script puts on PATH
    harness.write_text("set -euo pipefail\n" + head + f"export PATH={fake}:$PATH\n" + body + launch
                       + 'echo "MASTER=$MASTER_ADDR:$MASTER_PORT"\n')
    conf = tmp_path / "slurm.conf"  # scontrol's hostname expansion is local but needs a config to start
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nNodeName=gpu[001-999]\nPartitionName=p Nodes=ALL\n")
    env = dict(os.environ, SLURM_JOB_ID="123456", SLURM_CONF=str(conf),
               SLURM_JOB_NODELIST=f"gpu[001-{nodes:03d}]", SLURM_NNODES=str(nodes))
    out = subprocess.run(["bash", str(harness)], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    launches = [line for line in lines if line.startswith(launcher)]
    assert len(launches) == nodes
    port = 20000 + 123456 % 20000
    for node, line in enumerate(launches):  # every node gets its own rank, all agree on the rendezvous
        for want in LAUNCH_CHECKS[launcher]:
            assert want.format(nodes=nodes, node=node, world=nodes * 8, port=port) in line, (want, line)
        assert "--resume auto" in line
    if launcher == "deepspeed":  # the hostfile is the allocation, 8 slots a node
        hostfile = Path(script.split("OUTPUT_DIR=", 1)[1].split("\n", 1)[0]) / "hostfile"
        assert hostfile.read_text().splitlines() == [f"gpu{n:03d} slots=8" for n in range(1, nodes + 1)]
    assert lines[-1] == f"MASTER=gpu001:{port}"


@pytest.mark.parametrize("scontrol, nodelist", [('echo "scontrol: error: bad hostlist" >&2; exit 1', "gpu[001-"),
                                                ("exit 0", "gpu[001-002]"), (None, "")])
def test_the_script_stops_when_the_node_list_gives_no_rendezvous_host(tmp_path, capsys, scontrol, nodelist):
    """scontrol failing, printing nothing, or an empty SLURM_JOB_NODELIST: the job stops before any launch with one
    line naming the node list, instead of starting every node's launcher at an empty MASTER_ADDR."""
    assert main(["slurm", "render", str(_recipe(tmp_path, 16, global_batch=64)), "--partition", "gpu",
                 "--launcher", "deepspeed"]) == 0
    script = capsys.readouterr().out
    head = script.split("set -euo pipefail", 1)[1].split("# NCCL / torch.distributed defaults", 1)[0]
    fake = tmp_path / "fake"
    fake.mkdir()
    if scontrol is not None:  # the tool failing as it can on a node: its own stand-in ahead of the real one
        (fake / "scontrol").write_text(f"#!/usr/bin/env bash\n{scontrol}\n")
        (fake / "scontrol").chmod(0o755)
    harness = tmp_path / "head.sh"
    harness.write_text("set -euo pipefail\n" + head.replace("export PATH=", f"export PATH={fake}:", 1)
                       + 'echo "MASTER=$MASTER_ADDR"\n')
    env = dict(os.environ, SLURM_JOB_ID="7", SLURM_JOB_NODELIST=nodelist, SLURM_NNODES="2")
    out = subprocess.run(["bash", str(harness)], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 1 and "MASTER=" not in out.stdout, (out.stdout, out.stderr)
    assert f"[dmt] scontrol gave no hosts for SLURM_JOB_NODELIST='{nodelist}': not starting" in out.stderr


def test_render_rejects_an_allocation_that_does_not_match_the_plan(capsys):
    assert main(["slurm", "render", str(TINY), "--nodes", "3"]) == 2
    assert "--nodes" in capsys.readouterr().err
    assert main(["slurm", "render", str(TINY), "--time", "forever"]) == 2


@pytest.mark.parametrize("flags, named", [
    (["--nodes", "0"], "--nodes"),  # 0 is not "the recipe's node count"
    (["--gpus-per-node", "0"], "--gpus-per-node"),
    (["--partition", "gpu\n#SBATCH --qos=high"], "--partition"),  # would inject a line into the script
    (["--account", "my account"], "--account"),
    (["--out", "/nonexistent-dir/job.sbatch"], "--out"),
])
def test_render_bad_input_is_one_line_and_exit_2(flags, named):
    result = subprocess.run([sys.executable, "-m", "toolkit", "slurm", "render", str(TINY), *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and named in result.stderr and result.stdout == "", result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_render_refuses_a_deepspeed_json_for_a_megatron_recipe(capsys):
    megatron = ROOT / "recipes" / "tiny-llama-megatron-cpu.yaml"
    assert main(["slurm", "render", str(megatron), "--deepspeed", "ds.json"]) == 2
    assert "--deepspeed" in capsys.readouterr().err
    assert main(["slurm", "render", str(megatron), "--launcher", "accelerate", "--accelerate-config", "a.yaml"]) == 2
    assert "--launcher: the megatron backend runs under torchrun" in capsys.readouterr().err
    assert main(["slurm", "render", str(TINY), "--launcher", "accelerate"]) == 2
    assert "--accelerate-config" in capsys.readouterr().err
    assert main(["slurm", "render", str(megatron)]) == 0 and "--resume auto" in capsys.readouterr().out


def _job(slurm, job_id: str) -> dict:
    text = subprocess.run(["scontrol", "show", "job", job_id], env=slurm["env"], capture_output=True, text=True).stdout
    return dict(part.split("=", 1) for part in text.split() if "=" in part)


def _wait_job(slurm, job_id: str, states: tuple[str, ...], timeout: float) -> dict:
    """Wait until the job is in one of `states`; the wait ends as soon as it is, so `timeout` is generous: a job of
    the tiny recipe is a preflight, one or two launches (a requeue) and 6-60 steps of ~0.1-0.3 s, and one DeepSpeed
    start alone took ~50 s at load ~10 on 2 cores here and has taken minutes under heavier load (the former 600 s
    left a few x for that): 1800 s, and 900 s after USR1."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = _job(slurm, job_id)
        if job.get("JobState") in states:
            return job
        time.sleep(1)
    raise AssertionError(f"job {job_id} did not reach {states}: {job}")


def _submit(slurm, recipe: Path, out: Path, capsys, *flags: str, env: dict | None = None) -> str:
    """sbatch passes the submitting environment to the job: slurm["env"] and `env` reach the job's processes."""
    env_backup = dict(os.environ)
    os.environ.update(slurm["env"])
    os.environ.update(env or {})
    try:
        assert main(["slurm", "submit", str(recipe), "--output-dir", str(out), "--time", "00:30:00", *flags]) == 0
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    return capsys.readouterr().out.strip()


# a directory name a shell or sbatch would misread if any generated line interpolated it unquoted
HOSTILE = "we ird 'q' \"dq\" $(touch PWNED) `touch PWNED` #h 50% ü"


@pytest.mark.launch
def test_submitted_job_runs_preflight_trains_and_checkpoints(slurm, tmp_path, capsys):
    """A real job whose recipe, output and log directories sit under a hostile name: the #SBATCH lines, the script's
    variables and the launch line all keep it one word, and nothing in it runs."""
    hostile = tmp_path / HOSTILE
    hostile.mkdir()
    out = hostile / "run"
    job_id = _submit(slurm, _recipe(hostile, 2, 2), out, capsys)
    job = _wait_job(slurm, job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 1800)
    log = next((hostile / "slurm-logs").glob(f"*-{job_id}.out")).read_bytes().decode(errors="replace")
    assert not list(tmp_path.rglob("PWNED")) and not (Path.cwd() / "PWNED").exists()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", log[-3000:]
    assert "ranks on" in log and "preflight failed" not in log  # the health preflight ran (and passed) first
    records = read_metrics(out)
    assert records[-1]["step"] == 30 and records[-1]["loss"] < records[0]["loss"] - 1.0
    assert resolve_latest(out).name == "checkpoint-30"


@pytest.mark.launch
@pytest.mark.parametrize("launcher", ["accelerate", "deepspeed"])
def test_accelerate_and_deepspeed_launchers_train_under_slurm(slurm, tmp_path, capsys, launcher):
    """The other launch templates on the real Slurm: `accelerate launch` with the generated accelerate.yaml, and
    the deepspeed launcher with a hostfile built from the allocation (--no_ssh, node rank from the task)."""
    recipe = _recipe(tmp_path, 2, 2, max_steps=6, save_steps=6)
    generated = tmp_path / "gen"
    assert main(["generate", str(recipe), "--out", str(generated)]) == 0
    capsys.readouterr()
    out = tmp_path / "run"
    flags = ["--launcher", launcher, "--deepspeed", str(generated / "deepspeed.json")]
    flags += ["--accelerate-config", str(generated / "accelerate.yaml")] if launcher == "accelerate" else []
    job_id = _submit(slurm, recipe, out, capsys, *flags)
    job = _wait_job(slurm, job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 1800)
    log = next((tmp_path / "slurm-logs").glob(f"*-{job_id}.out")).read_bytes().decode(errors="replace")
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", log[-3000:]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))
    assert resolve_latest(out).name == "checkpoint-6"
    if launcher == "deepspeed":
        assert (out / "hostfile").read_text().strip().endswith("slots=2")


@pytest.mark.launch
def test_usr1_saves_requeues_and_the_next_run_resumes(slurm, tmp_path, capsys):
    out = tmp_path / "run"
    recipe = _recipe(tmp_path, 2, 2, max_steps=60, save_steps=1000)
    # The race: USR1 must reach training (this poll, scancel, slurmctld -> slurmd -> the batch shell's trap, the
    # request file, read at the end of a step) before step 60 ends, or the job completes without a requeue. Steps
    # take ~0.1-0.3 s, so the 40 steps after step 20 alone left a window of a few seconds that shrinks or grows
    # with the machine's speed. Every rank is therefore held 30 s at the start of step 21 (the first run only: a
    # requeued job runs with SLURM_RESTART_COUNT set, toolkit/runtime/faults.py), so the request arrives during
    # step 21 however fast the steps run: ~1 s idle for scancel to the trap, 30x margin. 30 s is far below the
    # recipe's hang timeout (600 s), so the watchdog does not take the hold for a hang.
    job_id = _submit(slurm, recipe, out, capsys, env={"DMT_FAULT": "slow=30@step=21,phase=train"})
    # waits for 20 logged steps (a preflight, a launch whose start alone took ~50 s at load ~10 here, 20 steps of
    # ~0.1-0.3 s); the wait ends when they are there, so its bound is generous: 900 s (was 300 s)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and len(read_metrics(out)) < 20:
        time.sleep(0.5)
    assert len(read_metrics(out)) >= 20, "training never got going"
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=slurm["env"], check=True)
    job = _wait_job(slurm, job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 900)
    log = next((tmp_path / "slurm-logs").glob(f"*-{job_id}.out")).read_bytes().decode(errors="replace")
    assert job["JobState"] == "COMPLETED" and int(job["Restarts"]) >= 1, log[-3000:]
    steps = [r["step"] for r in read_metrics(out)]
    saved = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    interrupted_at = saved[0]
    # saved on request (at the end of the held step 21), then finished after the requeue
    assert interrupted_at == 21 and saved[-1] == 60
    resumed = steps[steps.index(interrupted_at) + 1:]
    assert resumed[0] == interrupted_at + 1 and resumed[-1] == 60  # step numbers continue after the resume
    loss = {r["step"]: r["loss"] for r in read_metrics(out)}
    # the loss continues where it was, it does not restart from the untrained model's
    assert loss[interrupted_at + 1] < loss[1] - 1.0 and abs(loss[interrupted_at + 1] - loss[interrupted_at]) < 0.5, loss


@pytest.mark.launch  # with the launches that start the Slurm fixture: it adds about a second there
def test_the_nvl72_segment_line_meets_this_slurm(slurm, tmp_path, capsys):
    """An NVL72 plan's script asks for one rack's nodes with `#SBATCH --segment` (TopologyPlugin=topology/block;
    the option came with Slurm 24.05). A Slurm that has it takes the line; an older one (Debian 12's 22.05, this
    fixture's) refuses the script naming the option, the version limit docs/generating-and-launching.md states."""
    script = tmp_path / "nvl72.sbatch"
    assert main(["slurm", "render", str(ROOT / "recipes" / "qwen3-30b-a3b-megatron-gb200-nvl72.yaml"), "--out",
                 str(script)]) == 0, capsys.readouterr().err
    assert "#SBATCH --segment=16\n" in script.read_text()
    env = slurm["env"]
    knows = "--segment" in subprocess.run(["sbatch", "--help"], env=env, capture_output=True, text=True).stdout
    result = subprocess.run(["sbatch", "--test-only", str(script)], env=env, capture_output=True, text=True)
    if knows:  # the request is judged on its nodes and GPUs (this one-node fixture has neither), not its options
        assert "unrecognized option" not in result.stderr and "invalid option" not in result.stderr, result.stderr
    else:
        assert result.returncode != 0 and "--segment" in result.stderr, result.stderr
