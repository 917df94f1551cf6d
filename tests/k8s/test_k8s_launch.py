"""The Kubernetes manifests' wiring, run for real (issue 27): each kind's training container command is read from the
rendered manifest and run as the operator would run its pods, 2 "nodes" x 1 process on 127.0.0.1, with the
environment its controller injects (the Trainer's PET_* variables for a TrainJob; the JobSet's completion index
through the manifest's own fieldRef; the PyTorchJob operator's MASTER_ADDR, WORLD_SIZE and a RANK that is the node's
rank), the image's /workspace mapped to the project directory and the checkpoint PVC's mount to a temp dir.

Economy (the suite is near its time budget): three launches of 2 steps, each kind with another backend (TrainJob
with DeepSpeed, JobSet with FSDP2, PyTorchJob with Megatron-Core), so every kind and every backend runs once; the
TrainJob's run has a "pod" SIGKILLed after a checkpoint and the job restarted whole, as the JobSet under it does,
and the restart continues from that checkpoint; `dmt health`'s preflight runs as the TrainJob's init container
(with the PET_* variables its envInjection gives it) and inside the PyTorchJob's container before training."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, free_port, k8s_training_pod
from toolkit.checkpoint.manifest import MANIFEST, resolve_latest
from toolkit.checkpoint.verify import verify
from toolkit.cli.main import main
from toolkit.generate.k8s.render import CHECKPOINT_MOUNT, CONTAINER, PREFLIGHT
from toolkit.runtime.metrics import read_metrics

pytestmark = pytest.mark.launch
IMAGE = "registry.example.com/team/dmt:1.0"
NODES = 2
BIN = Path(sys.executable).parent
RUNS = {"trainjob": "tiny-llama-cpu", "jobset": "tiny-llama-fsdp-cpu", "pytorchjob": "tiny-llama-megatron-cpu"}
STEPS = {"trainjob": 4, "jobset": 2, "pytorchjob": 2}  # the TrainJob's run is the one killed after a checkpoint
KILL_AT = 2  # the checkpoint after which the TrainJob's pod is killed


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """The directory the image copies to /workspace: each backend's tiny recipe as 2 nodes x 1 process."""
    root = tmp_path_factory.mktemp("workspace")
    shutil.copytree(ROOT / "recipes" / "data", root / "data")
    for kind, name in RUNS.items():
        recipe = yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text())
        recipe["cluster"].update(gpus=NODES, gpus_per_node=1, nodes=NODES)
        recipe["training"].update(max_steps=STEPS[kind], save_steps=1 if kind == "trainjob" else STEPS[kind],
                                  warmup_steps=0,  # Megatron-Core: a warm-up shorter than the schedule
                                  hang_timeout_s=60)  # a node left waiting for a killed peer ends within a minute
        (root / f"{name}.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return root


@pytest.fixture(scope="module")
def manifests(project) -> dict:
    """Each kind rendered once by the CLI, as a user would (and checked by `dmt validate`)."""
    cwd = os.getcwd()
    os.chdir(project)
    try:
        for kind, name in RUNS.items():
            assert main(["k8s", "render", f"{name}.yaml", "--kind", kind, "--image", IMAGE, "--out",
                         f"{kind}.yaml"]) == 0
            assert main(["validate", f"{kind}.yaml"]) == 0
    finally:
        os.chdir(cwd)
    return {kind: list(yaml.safe_load_all((project / f"{kind}.yaml").read_text())) for kind in RUNS}


def _env(entries: list[dict], node: int) -> dict:
    """A container's env as the kubelet resolves it (the completion-index fieldRef is the pod's node index)."""
    resolved = {}
    for entry in entries:
        if "value" in entry:
            resolved[entry["name"]] = entry["value"]
        elif "job-completion-index" in entry["valueFrom"]["fieldRef"]["fieldPath"]:
            resolved[entry["name"]] = str(node)
    return resolved


def _injected(kind: str, documents: list[dict], node: int, port: int) -> dict:
    """What the controller adds (Trainer v2.3 torch plugin; training-operator v1.9.4 setPodEnv), with the pods'
    DNS names mapped to 127.0.0.1 and the port to a free one."""
    if kind == "trainjob":
        trainer = documents[-1]["spec"]["trainer"]
        return {"PET_NNODES": str(trainer["numNodes"]), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
                "PET_NODE_RANK": str(node), "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}
    if kind == "jobset":  # the manifest's own PET_* (from the completion index); only the address is mapped
        return {"PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}
    spec = documents[0]["spec"]
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(port), "WORLD_SIZE": str(NODES * int(spec["nprocPerNode"])),
            "RANK": str(node), "PET_NODE_RANK": str(node), "PET_NPROC_PER_NODE": spec["nprocPerNode"],
            "PET_NNODES": str(NODES), "PYTHONUNBUFFERED": "1"}


def _container(kind: str, documents: list[dict], name: str) -> tuple[list[str], list[dict]]:
    """The command and env of a container of the training pod (the TrainJob's trainer from its spec.trainer)."""
    pod = k8s_training_pod(kind, documents)
    if kind == "trainjob" and name == CONTAINER["trainjob"]:
        trainer = documents[-1]["spec"]["trainer"]
        return trainer["command"], trainer["env"]
    (container,) = [c for c in [*pod.get("initContainers", []), *pod["containers"]] if c["name"] == name]
    return container["command"], container["env"]


def _mapped(command: list[str], checkpoints: Path) -> list[str]:
    return [re.sub(f"^{CHECKPOINT_MOUNT}", str(checkpoints), part) for part in command]


class Pods:
    """The job's pods as processes: one process group per node, started together."""

    def __init__(self, kind: str, documents: list[dict], container: str, project: Path, checkpoints: Path,
                 logs: Path, fault: str | None = None):
        port = free_port()
        command, env = _container(kind, documents, container)
        self.logs, self.processes = [logs / f"{container}-node{n}.log" for n in range(NODES)], []
        logs.mkdir(parents=True, exist_ok=True)
        for node in range(NODES):
            environ = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", HF_HUB_OFFLINE="1",
                           DMT_HEALTH_HOSTNAME=f"pod-{node}")  # the pods' own host names
            environ.update(_env(env, node))  # the manifest's env, then what the controller injects over it
            environ.update(_injected(kind, documents, node, port))
            if fault:  # toolkit/runtime/faults.py: the tests' window to act in, however fast the steps
                environ["DMT_FAULT"] = fault
            with open(self.logs[node], "a") as log:
                self.processes.append(subprocess.Popen(_mapped(command, checkpoints), cwd=project, env=environ,
                                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def kill(self, node: int) -> None:
        os.killpg(self.processes[node].pid, signal.SIGKILL)

    def wait(self, timeout: float = 1800) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in self.processes]
        finally:
            for node, process in enumerate(self.processes):
                if process.poll() is None:
                    self.kill(node)
                    process.wait()

    def tail(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in self.logs)


@pytest.fixture(scope="module")
def runs(manifests, project, tmp_path_factory):
    """run(kind): that kind's job, run once however many tests ask: its checkpoint directory, its pods' logs and
    what each attempt returned."""
    done: dict = {}

    def run(kind: str) -> dict:
        if kind not in done:
            done[kind] = _run_job(kind, manifests[kind], project, tmp_path_factory.mktemp(f"pvc-{kind}"))
        return done[kind]

    return run


def _run_job(kind: str, documents: list[dict], project: Path, checkpoints: Path) -> dict:
    logs = checkpoints.parent / f"logs-{kind}"
    out = checkpoints / RUNS[kind]
    # the TrainJob's node 1 sleeps in the step after checkpoint KILL_AT, long enough to be SIGKILLed there
    fault = f"slow=60@rank=1,step={KILL_AT + 1},phase=train" if kind == "trainjob" else None
    pods = Pods(kind, documents, CONTAINER[kind], project, checkpoints, logs, fault)
    attempts, killed_after = [], None
    if kind == "trainjob":  # a pod SIGKILLed after a checkpoint; the JobSet then restarts every pod
        deadline = time.monotonic() + 900
        while killed_after is None and all(p.poll() is None for p in pods.processes) and time.monotonic() < deadline:
            latest = resolve_latest(out) if out.exists() else None
            if latest is not None and latest.name == f"checkpoint-{KILL_AT}":
                pods.kill(1)
                killed_after = (latest.name, (latest / MANIFEST).stat().st_mtime_ns)
                pods.kill(0)  # the JobSet's restart deletes every pod of the job
            time.sleep(0.05)
        attempts.append(pods.wait())
        pods = Pods(kind, documents, CONTAINER[kind], project, checkpoints, logs)
    attempts.append(pods.wait())
    return {"out": out, "pods": pods, "attempts": attempts, "killed_after": killed_after}


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_each_kind_trains_its_backend_on_two_nodes(runs, kind):
    run = runs(kind)
    assert run["attempts"][-1] == [0, 0], run["pods"].tail()
    records = read_metrics(run["out"])
    assert records and records[-1]["step"] == STEPS[kind], run["pods"].tail()
    latest = resolve_latest(run["out"])
    assert latest is not None and latest.name == f"checkpoint-{STEPS[kind]}"
    assert verify(latest).ok
    if kind == "pytorchjob":  # its preflight runs in the training container, before torchrun starts training
        assert "healthy" in run["pods"].logs[0].read_text()


def test_a_killed_pod_restarts_from_the_latest_checkpoint(runs):
    run = runs("trainjob")
    name, written = run["killed_after"]
    assert name == f"checkpoint-{KILL_AT}" and run["attempts"][0] == [-signal.SIGKILL, -signal.SIGKILL]
    checkpoint = run["out"] / name
    # the restart resumed from it (--resume auto): it was not written again, and training went on to the end
    assert (checkpoint / MANIFEST).stat().st_mtime_ns == written
    assert run["attempts"][1] == [0, 0], run["pods"].tail()


def test_the_preflight_runs_as_the_trainjobs_init_container(manifests, project, tmp_path):
    pods = Pods("trainjob", manifests["trainjob"], PREFLIGHT, project, tmp_path / "pvc", tmp_path / "logs")
    assert pods.wait(timeout=600) == [0, 0], pods.tail()
    assert "healthy" in pods.logs[0].read_text() and "2 ranks" in pods.logs[0].read_text()
