"""Helpers shared by the training and restore tests: paths, ports, logged launches."""

import os
import subprocess
import sys
from pathlib import Path

from toolkit.runtime.ports import free_port  # noqa: F401  (the tests' launches take their ports from it)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-llama-cpu.yaml"
# tiny HF configs of the MoE families (4 experts, top 2): Megatron-Core trains them at EP 2 (tests/megatron/conftest.py
# moe_run), DeepSpeed ZeRO-3 and FSDP2 with the experts sharded as ordinary parameters (tests/training, tests/fsdp)
_TINY_MOE_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=512, max_position_embeddings=128, tie_word_embeddings=False, hidden_act="silu",
                        bos_token_id=0, eos_token_id=0, num_experts_per_tok=2, router_aux_loss_coef=0.01)
TINY_MOE = {
    "qwen3_moe": dict(_TINY_MOE_COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=16,
                      intermediate_size=128, moe_intermediate_size=32, num_experts=4, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral": dict(_TINY_MOE_COMMON, architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=32,
                    num_local_experts=4),
    # MLA with a shared expert and the routing bias (also trained by Megatron-Core: tests/megatron); attention sinks
    # with biased, clamped experts (the HF Trainer backends; the Megatron-Core mapping tests its own tiny model:
    # tests/megatron/mcore_vs_hf.py)
    "deepseek_v3": dict(_TINY_MOE_COMMON, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                        num_key_value_heads=4, intermediate_size=128, q_lora_rank=None, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                        moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0),
    "gpt_oss": dict(_TINY_MOE_COMMON, architectures=["GptOssForCausalLM"], model_type="gpt_oss", head_dim=16,
                    intermediate_size=32, num_local_experts=4, layer_types=["full_attention", "full_attention"]),
}
MOE_SAVED = ("mixtral", "deepseek_v3", "gpt_oss")  # the families conftest.zero_checkpoints saves at ZeRO-3 (~4 s each)
# toolkit/train.py as every launcher starts it (deepspeed's runner spells it --module only; torchrun and accelerate
# take the same), and as one plain process
TRAIN = ("--module", "toolkit.train")
PYTHON_TRAIN = (sys.executable, "-m", "toolkit.train")


BIN = Path(sys.executable).parent  # the venv's launchers: deepspeed, torchrun, accelerate, ft_launcher


def run_logged(cmd: list[str], log: Path, timeout: float = 600, changes: dict | None = None) -> int:
    """Run a launcher, its output into `log`; the return code (tests also judge by what the run wrote). `changes`
    sets (or, with None, removes) environment variables."""
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", HF_HUB_OFFLINE="1")
    for key, value in (changes or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        return subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode


class Launch:
    """One finished launch: where it wrote, its exit code and its log."""

    def __init__(self, out: Path, rc: int, log: Path, shm_left: list | None = None):
        self.out, self.rc, self.log = out, rc, log
        self.shm_left = shm_left or []  # DeepSpeed CPU all-reduce segments of its port still in /dev/shm after it

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text().splitlines()[-lines:]) if self.log.exists() else "(no log)"


def tiny_llama_config(**overrides) -> dict:
    """A small HF Llama config.json dict (random init, no hub)."""
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1024,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        hidden_act="silu",
        bos_token_id=0,
        eos_token_id=0,
    )
    config.update(overrides)
    return config


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows (one dict per wandb.log call) of the one offline wandb run under `run_dir`/wandb, read from
    its .wandb file: wandb's record log (LevelDB log format: a 7-byte ':W&B' header, then 32 KiB blocks of records
    with a 7-byte header each: crc32, length, type FULL/FIRST/MIDDLE/LAST) of `wandb_internal_pb2.Record`s."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    (path,) = list((Path(run_dir) / "wandb").glob("offline-run-*/*.wandb"))
    data, block, position, pending, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B", path
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if length == 0 and kind == 0:
            position += left
            continue
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind in (2, 3):
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
            pending = b""
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
def launch_watched(cmd: list[str], log: Path, act, changes: dict | None = None, timeout: float = 1800) -> int:
    """Run a launcher with its output in `log`; every 50 ms `act(process)` may act on its ranks (stop or kill one)
    until it returns True. The launcher's exit code (the run is killed whole past `timeout`).

    `timeout` only bounds a run that ends by itself when things go well, so it is generous: a fault test's run is
    one or two launches (a restart) of 6 tiny steps, plus a held rank (20-30 s) or a hang timeout (10 s). Under load
    ~10 on 2 cores one DeepSpeed launch of the tiny recipe took ~70 s here, ~50 s of it before the first step, and
    has taken minutes under heavier load; the former 600 s left ~3x for a restarted job at load ~10. 1800 s leaves
    ~10x at that load. A run that really hangs is still ended, and the test then fails on its log."""
    import signal
    import time

    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", HF_HUB_OFFLINE="1")
    env.update(changes or {})
    log.parent.mkdir(parents=True, exist_ok=True)
    done, deadline = False, time.monotonic() + timeout
    with open(log, "w") as handle:
        process = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while process.poll() is None and time.monotonic() < deadline:
                done = done or bool(act(process))
                time.sleep(0.05)
        finally:
            if process.poll() is None:
                for child in rank_processes(process):
                    child.kill()
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode


def processes_with_env(name: str, value: str, grace_s: float = 60.0) -> list[int]:
    """The pids still alive, after at most `grace_s`, whose environment has name=value (what a launch gave its ranks
    and everything they started: nothing of a finished job may outlive it). It returns as soon as none is left, so
    the bound only decides a process that never exits (a loaded machine can take seconds to reap one)."""
    import time

    needle = f"{name}={value}".encode()
    deadline = time.monotonic() + grace_s
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if needle in (entry / "environ").read_bytes().split(b"\0"):
                        found.append(int(entry.name))
                except OSError:  # gone, or not ours to read
                    pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def pid_recorder(pids: dict, ranks=(0, 1, 2)):
    """A launch watcher's callback that records the pid of each of `ranks` as launched (their environment names the
    rank), before any fault; done once every rank is seen."""
    def record(process, *_) -> bool:
        for rank in ranks:
            if rank not in pids:
                found = rank_processes(process, rank=rank)
                if found:
                    pids[rank] = found[0].pid
        return len(pids) == len(ranks)
    return record


def assert_restarted_in_process(out: Path, text: str, pids: dict, resume_from: str, step: int) -> None:
    """An in-process restart (NVRx's Wrapper, launch.sh's `inprocess` launcher, one spare launched as rank 2) after
    rank 1 was SIGKILLed: the failure named, training resumed from `resume_from` at `step` in rank 0's own process
    (not relaunched), the spare now rank 1, and the restart's time measured."""
    from toolkit.runtime.incident import read_incidents

    # (a resume from a node-local checkpoint adds its own event: checkpoint.local's tests assert it)
    failure, restart, resumed = [event for event in read_incidents(out) if event["event"] != "local_resume"]
    assert failure["event"] == "failure" and "TERMINATED on ranks={1}" in failure["reason"], failure
    assert restart["resume_from"] == resume_from and restart["attempt"]["in_process"] == 1, restart
    assert resumed["event"] == "resumed" and resumed["pid"] == pids[0] and resumed["step"] == step, resumed
    assert f"in-process restart iteration 1: rank 1 of 2 (pid {pids[2]})" in text
    assert resumed["restart_s"] > 0  # measured and recorded (benchmarks/restart_time.md compares the figures)


def rank_processes(process, rank: int | None = None, attempt: str = "0") -> list:
    """The training processes (toolkit/train.py) below a launcher: all, or the one of `rank` in the launcher's
    first attempt (their environment says which)."""
    import psutil

    found = []
    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for child in children:
        try:
            environ, cmdline = child.environ(), " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "toolkit.train" not in cmdline or "RANK" not in environ:
            continue
        if rank is None or (environ["RANK"] == str(rank) and environ.get("TORCHELASTIC_RESTART_COUNT", "0") == attempt):
            found.append(child)
    return found


def kill_rank_after_save(checkpoint: str, killed: list, rank: int = 1):
    """A launch_watched action: once `latest` names `checkpoint`, SIGKILL `rank`'s training process of the first
    attempt (its pid appended to `killed`); act(process, out) is True once done.

    The race: the kill must land before the run goes past the next checkpoint, and, in a job with a hang timeout,
    before the watchdog ends the job for the rank the test holds back (a `slow` fault). It lands within a poll
    (50 ms) and a scan of the launcher's processes (psutil, ~0.1 s idle) of `latest` moving."""
    import signal

    from toolkit.checkpoint.manifest import resolve_latest

    def act(process, out) -> bool:
        latest = resolve_latest(out) if out.exists() else None
        if latest is not None and latest.name == checkpoint:
            for victim in rank_processes(process, rank=rank):
                victim.send_signal(signal.SIGKILL)
                killed.append(victim.pid)
        return bool(killed)

    return act


def calibration_data(hardware: str = "h100-80gb", scale: float = 0.25) -> dict:
    """A calibration as `dmt calibrate` writes it, both execution paths a Llama plan may take fitted at `scale`."""
    from toolkit.estimate.efficiency import HF, MEGATRON_TE

    run = {"run_dir": "runs/a", "execution_path": "hf", "plan": "deepspeed dp8 tp1 pp1 z1 mb2 rc=none", "steps": 7,
           "measured_step_time_s": 1.0, "predicted_step_time_s_before": 0.5, "predicted_step_time_s_after": 1.0,
           "error_before": -0.5, "error_after": 0.0}
    fitted = {"hf": {"compute_scale": scale, "uncalibrated": HF.compute_scale, "runs": 1},
              "megatron-te": {"compute_scale": scale, "uncalibrated": MEGATRON_TE.compute_scale, "runs": 1}}
    return {"format": "dmt-calibration/1", "hardware": hardware, "efficiency": fitted, "warmup_steps": 3,
            "runs": [run], "residuals": {"hf": {"runs": 1, "rms_error": 0.0, "max_abs_error": 0.0}},
            "created": "2026-11-25T00:00:00+00:00", "machine": {"host": "test"}}


H100_RANKS = {"accelerator": "gpu", "device": "NVIDIA H100 80GB HBM3", "device_gpu": "h100-80gb"}  # run_plan.json
RUN_STEPS = 10


def tiny_prediction() -> dict:
    """The tiny recipe's prediction on a catalogue GPU (h100-80gb; the recipe itself is planned for the host), as
    train.py records it in run_plan.json (with its model_spec)."""
    from toolkit.planner.recipe import recipe_plan, recipe_prediction
    from toolkit.spec.recipe import load_recipe, recipe_model

    recipe = load_recipe(TINY)
    recipe = recipe.model_copy(update={"cluster": recipe.cluster.model_copy(update={"gpu": "h100-80gb"})})
    model = recipe_model(recipe)
    plan = recipe_plan(recipe, model)
    return recipe_prediction(recipe, model, plan).as_json()


def write_run(path: Path, prediction: dict, device: dict = H100_RANKS, status: str = "completed",
              steps: int = RUN_STEPS) -> Path:
    """A run directory as a launch leaves it: run_plan.json and one metrics record a step, each step a fifth
    slower than predicted (so a calibration of it is an ordinary one)."""
    from toolkit.runtime.metrics import MetricsWriter, Throughput, end_run_record, start_run_record

    launch = {"argv": ["toolkit/train.py"], "plan_json": None, "world_size": 2, **device, "max_steps": steps}
    start_run_record(path, prediction, launch)
    end_run_record(path, status)
    step_time = prediction["step_time_s"] * 1.2
    tokens = prediction["plan"]["global_batch"] * prediction["plan"]["seq_len"]
    writer = MetricsWriter(path, Throughput(tokens))
    gpu = {"gpu_max_allocated_bytes": 2 * 2**30} if device.get("device") not in (None, "cpu") else {}
    for step in range(1, steps + 1):
        writer.write(step, 6.0 - 0.1 * step, 1.0, 1e-3, {"step_time_s": step_time, "tokens_per_s": tokens / step_time,
                                                         "mfu": prediction["mfu"] / 1.2, "data_wait_s": 1e-4, **gpu},
                     epoch=step / steps)
    return path


# a segment modified this recently when a sweep starts is left to a later sweep: it may be one a rank is creating
# while the sweep reads /proc (the process was read before it opened the file), and tmpfs stamps files with a coarse
# clock that may lag time.time() by a tick
SEGMENT_SETTLE_S = 1.0


def remove_segments_since(start: float) -> None:
    """Segments created since `start` that no live process holds: a launch still running keeps its own, whichever
    session started it (deleting a segment a peer has yet to open hangs that peer in DeepSpeed's shm setup: two test
    sessions on one machine did that to each other, and so did two pytest-xdist workers' sweeps)."""
    import time

    from toolkit.runtime.ds_shm import in_use, segments

    settled = time.time() - SEGMENT_SETTLE_S
    live = in_use()
    for path in segments():
        try:
            if start <= path.stat().st_mtime < settled and path not in live:
                path.unlink()
        except FileNotFoundError:
            pass


GUARD_PROBE = Path(__file__).resolve().parent / "guard_probe"  # its sitecustomize.py counts the guard's looks


def guard_probe_env(probe: Path) -> dict:
    """The environment changes that make a launched run count the guard's looks at the gradients into `probe`."""
    return {"DMT_GUARD_PROBE": str(probe),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(GUARD_PROBE), os.environ.get("PYTHONPATH")]))}


def guard_looks(probe: Path) -> tuple[dict[str, int], list[str]]:
    """What a probed run's ranks did: {rank: gradient-norm reads of one number}, and every other look (a norm of more
    than one element, a torch.isfinite from the toolkit's code)."""
    reads, others = {}, []
    for line in probe.read_text().splitlines():
        rank = line.rsplit("rank=", 1)[1]
        if line.startswith("read_grad_norm ") and " numel=1 " in line:
            reads[rank] = reads.get(rank, 0) + 1
        else:
            others.append(line)
    return reads, others


def assert_step_cost(record: dict, prediction: dict, tokens_per_step: int = 16 * 64) -> None:
    """What a step cost: its time, tokens/s from it, the data-loader wait inside it, and no CUDA allocator keys. A
    recipe planned for the host it trains on (`cluster.gpu: cpu`, as the tiny recipe) has its MFU against the host
    peak it was predicted with; a recipe naming an H100 trained on CPU ranks has a null MFU."""
    import pytest

    from toolkit.estimate.flops import model_flops_per_token
    from toolkit.spec.model import ModelSpec

    assert record["step_time_s"] > 0 and 0 <= record["data_wait_s"] < record["step_time_s"]
    assert record["tokens_per_s"] == pytest.approx(tokens_per_step / record["step_time_s"])
    assert not [key for key in record if key.startswith("gpu_")]
    if prediction["gpu"] != "cpu":
        assert record["mfu"] is None
        return
    flops = model_flops_per_token(ModelSpec(**prediction["model_spec"]), 64) * tokens_per_step
    assert prediction["peak_tflops"] > 0
    assert record["mfu"] == pytest.approx(flops / (record["step_time_s"] * 2 * prediction["peak_tflops"] * 1e12))


def k8s_training_pod(kind: str, documents: list[dict]) -> dict:
    """The training pod's spec in a manifest `dmt k8s render` wrote, where each kind keeps it (a TrainJob's in the
    TrainingRuntime before it)."""
    if kind == "trainjob":
        return documents[0]["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    if kind == "jobset":
        return documents[0]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return documents[0]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]


# The files of a directory whose tests assert on the same session-scoped launches (SESSION_LAUNCHES): one group each,
# so that one worker runs them all and every shared launch still runs once. Every other file is a group of its own,
# so that the long launches of one directory spread over both workers.
SHARED_LAUNCHES = {
    "megatron": ("test_megatron_convert.py", "test_megatron_logits.py", "test_megatron_train.py"),
    "checkpoint": ("test_verify.py", "test_zero_to_hf.py"),
    "fsdp": ("test_fsdp_convert.py", "test_fsdp_memory.py", "test_fsdp_train.py"),
}
# the session fixtures that launch (conftest.py files), whose users must share a group (tests/unit/test_launch_groups.py)
SESSION_LAUNCHES = ("layout_run", "moe_run", "dp2_resumed", "zero_checkpoints", "accelerate_run", "torchrun_restore",
                    "moe_reshard")
SHARED_BY_DIRECTORY = {"slurm"}  # the Slurm daemons: one cluster at a time


def launch_group(nodeid: str) -> str:
    """The group a test runs in on the 2-worker launch lane: its file, or its directory where launches are shared
    across files ('tests/megatron/test_megatron_train.py::test_y' -> 'megatron')."""
    directory, *rest = nodeid.split("::", 1)[0].split("/")[1:]  # below tests/
    if directory in SHARED_BY_DIRECTORY or not rest or rest[-1] in SHARED_LAUNCHES.get(directory, ()):
        return directory
    return "/".join((directory, *rest))


def launch_scheduler(config, log):
    """For `--dist loadgroup` (tests/conftest.py's pytest_xdist_make_scheduler): xdist's own loadscope scheduler with
    launch_group as the scope: every test of a group on one worker, in file order, the groups with the most tests
    first. None (xdist's choice) for any other `--dist`.

    Not by `xdist_group` markers: pytest-xdist 3.8 writes a marked test's group into `item._nodeid`, which pytest 9.2
    no longer reads (Node.nodeid is `_id` now), so marked tests were spread test by test: two Slurm clusters at once,
    whose first jobs took the same MASTER_PORT, and a browser test on another worker than the one that set its page
    up. tests/unit/test_launch_groups.py fails if a group is split again."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LaunchGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return launch_group(nodeid)

    return LaunchGroups(config, log)


# A hang guard of the fuzz files (test_fuzz_*.py), never a verdict on speed: it only ends a case that would otherwise
# hang (a read without end, a blocked FIFO, a lost signal, a worker that never starts). A refusal of bad input takes
# under 1 s in-process, ~3-5 s as a fresh `python -m toolkit`, and the slowest case (YAML nested 100000 deep) took
# 10.6 s at load ~16 on 2 cores, past the former 10 s assert: 120 s is 11x that.
FUZZ_HANG_GUARD_S = 120

# Address space a bounded child (`bounded`) may map beyond what it forked with: importing torch maps 0.6 GiB, and a
# read that inflates past this (a compression bomb, /dev/zero) fails the case instead of swapping the machine.
FUZZ_HEADROOM = 2 * 2**30


def vm_bytes() -> int:
    """This process's mapped address space (VmSize), what `bounded` adds FUZZ_HEADROOM to."""
    import re

    return int(re.search(r"VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def bounded(call, headroom: int = FUZZ_HEADROOM) -> tuple[int, list[str], list[str], float]:
    """(exit code, stdout lines, stderr lines, seconds) of `call()` (an exit code; a UserInputError it raises is exit
    2 and its one line, as the CLI prints it; anything else that escapes is its traceback and exit 99) in a forked
    child that SIGALRM kills after FUZZ_HANG_GUARD_S and that may not map more than `headroom` bytes beyond what it
    forked with; a child killed so fails the case. The fuzz files' hang guard, and any test's whose regression would
    block (a FIFO, a worker waited for): the alarm ends only a hang, it is no verdict on speed."""
    import resource
    import signal
    import tempfile
    import time
    import traceback

    import pytest

    from toolkit.errors import UserInputError, error_line

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            code = 99  # anything that escapes is a traceback and this code
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout, sys.stderr = os.fdopen(1, "w", closefd=False), os.fdopen(2, "w", closefd=False)
                resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + headroom, resource.RLIM_INFINITY))
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.alarm(FUZZ_HANG_GUARD_S)
                try:
                    code = call()
                except UserInputError as exc:
                    print(error_line("dmt", exc), file=sys.stderr)
                    code = 2
            except BaseException:  # noqa: BLE001 (a MemoryError or a failed assert too: the case reports it)
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        seconds = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if os.WIFSIGNALED(status):
        pytest.fail(f"killed by signal {os.WTERMSIG(status)} after {seconds:.1f} s (blocked or read without end); "
                    f"stderr: {stderr[-2000:]}")
    lines = [line for line in stderr.splitlines() if line.strip()]
    return os.WEXITSTATUS(status), stdout.splitlines(), lines, seconds


PROFILED = ("2", "3")  # --profile-steps of the launches that record a profile (an existing launch per backend)
PROFILE_TERMS = ("compute_s", "communication_exposed_s", "data_wait_s", "optimizer_s", "checkpoint_s", "idle_s")


def assert_profiled(out: Path, ranks=(0, 1)) -> dict:
    """A run launched with --profile-steps 2-3: each rank's trace in OUTPUT/profile/ opens in Holistic Trace Analysis
    with both profiled steps in it; `dmt report --breakdown --json` gives each step and rank's terms, which add up to
    the measured step (the sum of the terms measured from events never past it), beside the predicted terms with the
    largest gap named. Returns the breakdown."""
    import json
    from contextlib import redirect_stdout
    from io import StringIO

    from hta.trace_analysis import TraceAnalysis

    from toolkit.cli.main import main

    first = PROFILED[0]
    traces = sorted(p.name for p in (out / "profile").glob("*.pt.trace.json"))
    assert traces == [f"rank{rank}.{first}.pt.trace.json" for rank in ranks], traces
    analysis = TraceAnalysis(trace_dir=str(out / "profile"), include_last_profiler_step=True)
    assert sorted(analysis.t.get_ranks()) == list(ranks)
    symbols = analysis.t.symbol_table.sym_table
    for rank in ranks:
        names = {symbols[index] for index in analysis.t.get_trace(rank)["name"]}
        assert {"ProfilerStep#1", "ProfilerStep#2"} <= names or {"ProfilerStep#2", "ProfilerStep#3"} <= names, rank
    printed = StringIO()
    with redirect_stdout(printed):
        assert main(["report", str(out), "--breakdown", "--json"]) == 0
    [run] = json.loads(printed.getvalue())["runs"]
    breakdown = run["breakdown"]
    rows = breakdown["steps"]
    assert sorted((r["step"], r["rank"]) for r in rows) == [(int(s), r) for s in PROFILED for r in ranks], rows
    for row in rows:
        terms = sum(row[t] for t in PROFILE_TERMS)
        assert abs(terms - row["step_s"]) <= 0.1 * row["step_s"], row
        assert 0 < terms - row["idle_s"] <= row["step_s"] * (1 + 1e-9) and row["compute_s"] > 0, row
    logged = {record["step"]: record.get("step_time_s")
              for record in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in record}
    for row in (r for r in rows if r["rank"] == 0):
        terms, step_time = sum(row[t] for t in PROFILE_TERMS), logged.get(row["step"])
        assert step_time is not None and abs(terms - step_time) <= 0.1 * step_time, (row, step_time)
    assert breakdown["predicted"] is not None and breakdown["gap"].startswith("largest gap: "), breakdown
    assert set(breakdown["predicted_terms"]) >= {"compute_s", "dp_comm_s", "bubble_s", "optimizer_s"}, breakdown
    return breakdown


def safetensors_tensors(directory: Path) -> dict:
    """Every tensor of the *.safetensors files in `directory`, by name."""
    from safetensors import safe_open

    found = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            found.update({key: handle.get_tensor(key) for key in handle.keys()})
    return found
