"""`dmt restore-test`: prove a run comes back. Reference run; a run killed (SIGKILL) right after saving at step K;
a resumed run; then per-step loss, grad norm, learning rate and data fingerprint must match the reference.

It only launches the training entry (toolkit/train.py) three times, so the same check runs on a laptop's CPU ranks
or against a real multi-GPU recipe on a cluster node.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.checkpoint.manifest import resolve_latest
from toolkit.errors import UserInputError, worker_error
from toolkit.runtime.children import Children, end_tree
from toolkit.runtime.ds_shm import release
from toolkit.runtime.incident import read_incidents
from toolkit.runtime.metrics import METRICS_FILE, read_metrics
from toolkit.runtime.ports import free_port

TRAIN = ("--module", "toolkit.train")  # every launcher's spelling (deepspeed's runner has no -m)
COMPARED = ("loss", "grad_norm", "learning_rate", "data_sha")
# compared exactly where the test is bitwise: an MoE run's routing (toolkit/backends/megatron/moe.py), the same
# tokens to the same experts at every step; a resharded resume may route a near-tie the other way
ROUTING = ("moe_tokens_per_expert",)
LAUNCHERS = {"deepspeed": "--num_gpus", "torchrun": "--nproc_per_node"}  # the launchers it runs: their count flag


@dataclass
class RestoreResult:
    steps: int
    save_at: int
    killed_at_step: int | None
    reference_losses: list[float]
    resumed_losses: list[float]
    max_abs_diff: float
    identical: bool
    passed: bool
    tolerance: float
    mismatches: list[str] = field(default_factory=list)
    checkpoint: str = ""
    resumed_at: int = 0  # the step the resumed run continued after: save_at, or a newer local checkpoint's

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _command(launcher: str, nprocs: int, recipe: Path, out: Path, steps: int, save_steps: int, resume: bool,
             extra: tuple[str, ...] = ()) -> list[str]:
    if launcher not in LAUNCHERS:
        raise UserInputError("--launcher", f"'{launcher}' is not supported; use {' or '.join(LAUNCHERS)}")
    head = [str(Path(sys.executable).parent / launcher), LAUNCHERS[launcher], str(nprocs), "--master_port",
            str(free_port()), *TRAIN]
    tail = ["--recipe", str(recipe), "--output-dir", str(out), "--max-steps", str(steps), "--save-steps", str(save_steps)]
    return head + tail + list(extra) + (["--resume", "latest"] if resume else [])


@contextlib.contextmanager
def _launched(cmd: list[str], log: Path, run: str):
    """A training launch, its output into `log`; the launch ends with the block, however the block ends (torchrun
    starts each worker in a session of its own: toolkit.runtime.children ends them too)."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    try:
        with open(log, "w") as handle, Children(f"{run}'s training") as children:
            yield children.start(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env)
    finally:
        if "--master_port" in cmd:  # DeepSpeed's CPU all-reduce segments outlive SIGKILLed ranks

            release(cmd[cmd.index("--master_port") + 1])


def _run(cmd: list[str], log: Path, timeout: float, run: str) -> int:
    with _launched(cmd, log, run) as process:
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise UserInputError("--timeout", f"a training launch ran past {timeout:.0f} s; see {log}") from None


def _run_and_kill_after_save(cmd: list[str], out: Path, save_at: int, log: Path, timeout: float) -> int | None:
    """Start training, SIGKILL it and every process below it once `latest` names checkpoint-<save_at>; the step
    reached."""
    deadline = time.monotonic() + timeout
    with _launched(cmd, log, "the interrupted run") as process:
        while time.monotonic() < deadline and process.poll() is None:
            latest = resolve_latest(out)
            if latest is not None and latest.name == f"checkpoint-{save_at}":
                end_tree(process, grace_s=0)  # a crash: no time to clean up
                steps = [r["step"] for r in read_metrics(out)]
                return max(steps, default=None)
            time.sleep(0.05)
        if process.poll() is None:
            raise UserInputError("--timeout", f"no checkpoint at step {save_at} within {timeout:.0f} s; see {log}")
    raise _failed(log, "the interrupted run") or UserInputError(
        "--save-at", f"training ended (rc={process.returncode}) before it saved step {save_at}; see {log}")


def _failed(log: Path, run: str) -> UserInputError | None:
    """The worker's own one-line error of a launch that failed (a bad recipe value only training finds)."""
    return worker_error(log.read_text(errors="replace") if log.is_file() else "", f"{run}; log: {log}")


def _by_step(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records}


# what a restore test writes into its work directory: the runs' directories and their logs
REFERENCE, INTERRUPTED = "reference", "interrupted"
LOGS = {run: f"{run}.log" for run in (REFERENCE, INTERRUPTED, "resumed")}
WORKDIR_ENTRIES = (REFERENCE, INTERRUPTED, *LOGS.values())


def restore_test(recipe: Path, workdir: Path, steps: int, save_at: int, nprocs: int, resume_nprocs: int | None = None,
                 launcher: str = "deepspeed", tolerance: float = 0.0, timeout: float = 900,
                 train_args: tuple[str, ...] = (), resume_args: tuple[str, ...] = ()) -> RestoreResult:
    """`train_args` (e.g. ("--zero", "3")) go to every launch of toolkit/train.py, `resume_args` (e.g. ("--ep", "1"),
    a layout the checkpoint reshards to) to the resumed one after them."""
    if not 0 < save_at < steps:
        raise UserInputError("--save-at", f"must be between 1 and --steps - 1 = {steps - 1}, got {save_at}")
    resharded = resume_nprocs is not None and resume_nprocs != nprocs  # train.py reshards: dist / universal ckpt
    workdir.mkdir(parents=True, exist_ok=True)
    reference, run = workdir / REFERENCE, workdir / INTERRUPTED
    log = {name: workdir / file for name, file in LOGS.items()}
    for path in (reference, run):
        if path.exists() and any(path.iterdir()):
            raise UserInputError("--workdir", f"{path} is not empty; use a new --workdir")

    rc = _run(_command(launcher, nprocs, recipe, reference, steps, steps, False, train_args), log["reference"], timeout,
              "the reference run")
    ref = _by_step(read_metrics(reference))
    if steps not in ref:
        raise _failed(log["reference"], "the reference run") or UserInputError(
            "--recipe", f"the reference run did not reach step {steps} (rc={rc}); see {log['reference']}")
    killed_at = _run_and_kill_after_save(_command(launcher, nprocs, recipe, run, steps, save_at, False, train_args), run, save_at,
                                         log["interrupted"], timeout)
    os.replace(run / METRICS_FILE, run / f"killed.{METRICS_FILE}")
    checkpoint = resolve_latest(run)
    resume_args = train_args + (("--gpus", str(resume_nprocs)) if resharded else ()) + resume_args
    rc = _run(_command(launcher, resume_nprocs or nprocs, recipe, run, steps, steps, True, resume_args),
              log["resumed"], timeout, "the resumed run")
    resumed = _by_step(read_metrics(run))
    if steps not in resumed:
        raise _failed(log["resumed"], "the resumed run") or UserInputError(
            "--recipe", f"the resumed run did not reach step {steps} (rc={rc}); see {log['resumed']}")
    # a node-local checkpoint (checkpoint.local) newer than `latest`, written before the kill, is what the resume
    # read: the steps after it are compared
    local = [e for e in read_incidents(run) if e.get("event") == "local_resume"]
    resumed_at = local[-1]["step"] if local else save_at
    if local:
        checkpoint = f"the local checkpoint of step {resumed_at} in {local[-1]['dir']}"
    compared = list(range(resumed_at + 1, steps + 1))
    mismatches, max_diff = [], 0.0
    for step in compared:
        for key in COMPARED:
            a, b = ref[step].get(key), resumed.get(step, {}).get(key)
            if key != "data_sha" and a is not None and b is not None:
                max_diff = max(max_diff, abs(a - b)) if key == "loss" else max_diff
                if abs(a - b) > tolerance:
                    mismatches.append(f"step {step} {key}: {a} vs {b}")
            elif a != b:
                mismatches.append(f"step {step} {key}: {a} vs {b}")
        for key in ROUTING if tolerance == 0 else ():
            if ref[step].get(key) != resumed.get(step, {}).get(key):
                mismatches.append(f"step {step} {key}: {ref[step].get(key)} vs {resumed.get(step, {}).get(key)}")
    identical = all(ref[s].get(k) == resumed.get(s, {}).get(k) for s in compared for k in COMPARED + ROUTING)
    return RestoreResult(
        steps=steps, save_at=save_at, killed_at_step=killed_at,
        reference_losses=[ref[s]["loss"] for s in compared],
        resumed_losses=[resumed.get(s, {}).get("loss") for s in compared],
        max_abs_diff=max_diff, identical=identical, passed=not mismatches, tolerance=tolerance,
        mismatches=mismatches, checkpoint=str(checkpoint), resumed_at=resumed_at,
    )
