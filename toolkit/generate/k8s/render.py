"""The resolved plan as a Kubernetes manifest: a Kubeflow TrainJob (with the TrainingRuntime it needs), a JobSet or a
PyTorchJob. Pure: recipe, plan and names in, YAML text out.

Every kind runs the same training command as launch.sh and slurm.sbatch: torchrun starts `toolkit/train.py` (the
module toolkit.train) with `--recipe`, `--plan` when given, the output directory on the checkpoint PVC and
`--resume auto`, for every backend (DeepSpeed under torchrun: no SSH, no MPI hostfile). torchrun reads its
rendezvous from the PET_* variables, as its flags' defaults: the Trainer's torch plugin injects them into a TrainJob,
a JobSet's pods get them here from their completion index, and the PyTorchJob operator sets them itself (beside a
RANK that is the node's rank, which torchrun replaces with each process's own).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from toolkit.errors import UserInputError
from toolkit.generate.ft_launcher import nic_monitor_flag
from toolkit.generate.k8s import names, nvlink
from toolkit.generate.k8s.shm import quantity, shm_bytes
from toolkit.generate.k8s.vendored import stock_runtime
from toolkit.generate.launch import FT_LAUNCHER, job_variables, plan_variables, preflight_flags
from toolkit.numeric import yaml_text
from toolkit.spec.plan import Plan
from toolkit.spec.recipe import Recipe, data_workers

KINDS = ("trainjob", "jobset", "pytorchjob")
WORKDIR = "/workspace"  # where the image holds the directory `dmt k8s render` ran in (its recipe, plan, data)
CHECKPOINT_MOUNT = "/checkpoints"  # where the checkpoint PVC is mounted; the run's output directory is under it
SHM_MOUNT = "/dev/shm"
MASTER_PORT = 29500
GPU_RESOURCE = "nvidia.com/gpu"
PLAN_ANNOTATION = "dm-toolkit.io/plan"  # the plan the manifest was rendered from, for `dmt validate`
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# the variables a Kubeflow TrainJob's torch runtime owns (and its webhook refuses when set by hand)
PET_VARIABLES = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
TRAIN_MODULE = "toolkit.train"  # toolkit/train.py, as launch.sh and slurm.sbatch run it
PREFLIGHT = "preflight"  # the init container that runs `dmt health` before training
API_VERSIONS = {"TrainJob": "trainer.kubeflow.org/v1alpha1", "TrainingRuntime": "trainer.kubeflow.org/v1alpha1",
                "JobSet": "jobset.x-k8s.io/v1alpha2", "PyTorchJob": "kubeflow.org/v1"}
# the training container's name, which each operator looks for
CONTAINER = {"trainjob": "node", "jobset": "node", "pytorchjob": "pytorch"}
FILE_NAME = "k8s-trainjob.yaml"  # what `dmt generate` writes when the recipe names an image


@dataclass(frozen=True)
class K8sJob:
    """What a manifest is rendered from: the recipe and its plan, and the names the cluster knows them by."""

    recipe: Recipe
    plan: Plan
    image: str
    train_args: tuple[str, ...]
    namespace: str | None = None
    checkpoint_pvc: str | None = None
    queue: str | None = None
    ft_config: str | None = None  # ft_launcher's ft_config.yaml as the container sees it: training runs under it

    @property
    def name(self) -> str:
        return names.object_name(self.recipe.name)

    @property
    def nodes(self) -> int:
        return self.recipe.cluster.num_nodes

    @property
    def per_node(self) -> int:
        return self.plan.gpus // self.nodes

    @property
    def pvc(self) -> str:
        return self.checkpoint_pvc or f"{self.name}-checkpoints"

    @property
    def gpus(self) -> bool:
        return self.recipe.cluster.accelerator == "gpu"


def container_path(path: Path, flag: str, cwd: Path | None = None) -> str:
    """A file the job reads, as the container sees it: relative to WORKDIR, which holds the directory `dmt k8s
    render` runs in (the image copies it there)."""
    cwd = (cwd or Path.cwd()).resolve()
    try:
        relative = Path(path).resolve().relative_to(cwd)
    except ValueError:
        raise UserInputError(flag, f"{path} is outside {cwd}: the image holds that directory at {WORKDIR}, so the job "
                                   f"can read only what is under it; run from a directory that holds it") from None
    return PurePosixPath(*relative.parts).as_posix()


def train_arguments(recipe: Recipe, recipe_path: Path, plan_path: Path | None = None,
                    cwd: Path | None = None) -> tuple[str, ...]:
    """toolkit/train.py's arguments in every pod: the recipe, the generated plan if any, the run's directory on the
    checkpoint PVC and `--resume auto` (a restarted pod continues from the latest verified checkpoint)."""
    args = ["--recipe", container_path(recipe_path, "RECIPE", cwd)]
    if plan_path is not None:
        args += ["--plan", container_path(plan_path, "--plan", cwd)]
    return (*args, "--output-dir", f"{CHECKPOINT_MOUNT}/{recipe.name}", "--resume", "auto")


def make_job(recipe: Recipe, plan: Plan, image: str | None, recipe_path: Path, plan_path: Path | None = None,
             namespace: str | None = None, checkpoint_pvc: str | None = None, queue: str | None = None,
             cwd: Path | None = None, ft_config: Path | None = None) -> K8sJob:
    """The job, every name checked first (one line naming the flag on the first bad one), then the files it reads
    as the container sees them."""
    image = image or recipe.cluster.k8s.image
    if not image:
        raise UserInputError("--image", "is required (or cluster.k8s.image in the recipe): the container image that "
                                        f"holds the toolkit and this directory at {WORKDIR}")
    # an empty name given (`--queue "$QUEUE"` with QUEUE unset) is refused as a name, never read as "not given": a
    # job meant for a Kueue queue would otherwise be submitted unqueued, into kubectl's current namespace
    checked = (names.image_reference(image), None if namespace is None else names.namespace(namespace),
               None if checkpoint_pvc is None else names.claim_name(checkpoint_pvc),
               None if queue is None else names.queue_name(queue))
    if plan.gpus % recipe.cluster.num_nodes:
        raise UserInputError("cluster.nodes", f"{plan.gpus} processes do not split evenly over "
                                              f"{recipe.cluster.num_nodes} nodes")
    args = train_arguments(recipe, recipe_path, plan_path, cwd)
    ft = container_path(ft_config, "--launcher", cwd) if ft_config is not None else None
    return K8sJob(recipe, plan, checked[0], args, *checked[1:], ft_config=ft)


def _env(variables) -> list[dict]:
    return [{"name": v.name, "value": v.value} for v in variables]


def _resources(job: K8sJob) -> dict:
    if not job.gpus:  # a CPU recipe asks for no GPU (gloo ranks)
        return {}
    gpus = {GPU_RESOURCE: job.per_node}
    return {"requests": dict(gpus), "limits": dict(gpus)}


def _mounts() -> list[dict]:
    return [{"name": "dshm", "mountPath": SHM_MOUNT}, {"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT}]


def _volumes(job: K8sJob) -> list[dict]:
    size = quantity(shm_bytes(job.plan, job.per_node, data_workers(job.recipe)))
    return [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}},
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": job.pvc}}]


def _container(job: K8sJob, name: str, command: list[str], env: list[dict]) -> dict:
    container = {"name": name, "image": job.image, "workingDir": WORKDIR, "command": command, "env": env,
                 "volumeMounts": _mounts()}
    if _resources(job):
        container["resources"] = _resources(job)
    return container


def _torchrun(module: str, *args: str) -> list[str]:
    return ["torchrun", "-m", module, *args]


def _trainer(job: K8sJob) -> list[str]:
    """The training command: torchrun, or NVRx's ft_launcher (its drop-in, same PET_* variables) with ft_config.yaml."""
    if job.ft_config is None:
        return _torchrun(TRAIN_MODULE, *job.train_args)
    return [FT_LAUNCHER, "--ft-cfg-path", job.ft_config, "--ft-enable-nic-monitor", nic_monitor_flag(job.recipe),
            "-m", TRAIN_MODULE, *job.train_args]


def _job_env(job: K8sJob) -> list[dict]:
    return _env(job_variables(job.recipe)) + _env(plan_variables(job.plan))


def _metadata(job: K8sJob, name: str | None = None, plan: bool = True) -> dict:
    metadata: dict = {"name": name or job.name}
    if job.namespace:
        metadata["namespace"] = job.namespace
    if job.queue and plan:
        metadata["labels"] = {QUEUE_LABEL: job.queue}
    if plan:
        record = {"plan": job.plan.as_dict(), "nodes": job.nodes, "accelerator": job.recipe.cluster.accelerator}
        metadata["annotations"] = {PLAN_ANNOTATION: json.dumps(record, separators=(",", ":"), sort_keys=True)}
    return metadata


def _pod_spec(job: K8sJob, containers: list[dict], init: list[dict] | None = None, restart: str = "Never") -> dict:
    spec: dict = {"restartPolicy": restart}
    if init:
        spec["initContainers"] = init
    return {**spec, "containers": containers, "volumes": _volumes(job)}


def _rendezvous_from_index(job: K8sJob) -> list[dict]:
    """The PET_* variables torchrun reads, from the JobSet's own names: node 0 is pod 0 of the one indexed Job, found
    through the headless service JobSet makes (publishing pods before they are ready: the preflight meets there)."""
    master = f"{job.name}-node-0-0.{job.name}"
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    return [{"name": "PET_NNODES", "value": str(job.nodes)}, {"name": "PET_NPROC_PER_NODE", "value": str(job.per_node)},
            {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": index}}},
            {"name": "PET_MASTER_ADDR", "value": master}, {"name": "PET_MASTER_PORT", "value": str(MASTER_PORT)}]


def trainjob(job: K8sJob) -> list[dict]:
    """A TrainingRuntime of our own (the stock torch-distributed one, vendored in crds/, plus what the plan needs:
    /dev/shm, the checkpoint PVC, the preflight, the restart policy) and the TrainJob that uses it. The preflight
    gets the PET_* variables through the runtime's v2.3 envInjection; the trainer's env never sets them."""
    runtime = stock_runtime()
    runtime["kind"] = "TrainingRuntime"
    runtime["metadata"] = {**_metadata(job, f"{job.name}-torch", plan=False),
                           "labels": runtime["metadata"].get("labels", {})}
    runtime["spec"]["mlPolicy"] = {"numNodes": job.nodes, "torch": {"envInjection": {"targets": [
        {"jobName": "node", "containerNames": [PREFLIGHT]}]}}}
    template = runtime["spec"]["template"]["spec"]
    template["failurePolicy"] = {"maxRestarts": job.recipe.training.max_restarts}
    (node,) = template["replicatedJobs"]
    node["template"]["spec"]["backoffLimit"] = 0  # a failed pod fails its Job; the JobSet restarts every node
    pod = node["template"]["spec"]["template"]["spec"]
    (trainer,) = pod["containers"]
    preflight = _container(job, PREFLIGHT, _torchrun("toolkit", "health", *preflight_flags(job.recipe)),
                           _job_env(job))
    pod.update(_pod_spec(job, [{**trainer, "image": job.image, "workingDir": WORKDIR, "volumeMounts": _mounts()}],
                         [preflight]))
    train = {"image": job.image, "command": _trainer(job), "numNodes": job.nodes,
             "numProcPerNode": job.per_node, "env": _job_env(job)}
    if _resources(job):
        train["resourcesPerNode"] = _resources(job)
    return [runtime, {"apiVersion": API_VERSIONS["TrainJob"], "kind": "TrainJob", "metadata": _metadata(job),
                      "spec": {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                                              "name": runtime["metadata"]["name"]}, "trainer": train}}]


def jobset(job: K8sJob) -> list[dict]:
    """One replicated Job of `nodes` indexed pods behind JobSet's headless service; the JobSet restarts every pod
    (failurePolicy) when one fails, and each continues from the latest checkpoint."""
    env = _rendezvous_from_index(job) + _job_env(job)
    trainer = _container(job, CONTAINER["jobset"], _trainer(job), env)
    preflight = _container(job, PREFLIGHT, _torchrun("toolkit", "health", *preflight_flags(job.recipe)), env)
    indexed = {"parallelism": job.nodes, "completions": job.nodes, "completionMode": "Indexed", "backoffLimit": 0,
               "template": {"spec": _pod_spec(job, [trainer], [preflight])}}
    return [{"apiVersion": API_VERSIONS["JobSet"], "kind": "JobSet", "metadata": _metadata(job), "spec": {
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
        "failurePolicy": {"maxRestarts": job.recipe.training.max_restarts},
        "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": indexed}}]}}]


def pytorchjob(job: K8sJob) -> list[dict]:
    """Kubeflow's legacy PyTorchJob: a Master and nodes-1 Workers. The operator puts its variables in the
    containers only, and publishes a replica's Service once the pod is ready, so an init container could neither
    rendezvous nor be reached: the preflight runs in the training container, before torchrun starts training."""
    flags = " ".join(shlex.quote(flag) for flag in preflight_flags(job.recipe))
    launcher = shlex.join(_trainer(replace(job, train_args=()))) + ' "$@"'  # the arguments: "$@"
    script = f'torchrun -m toolkit health {flags} && exec {launcher}'
    trainer = _container(job, CONTAINER["pytorchjob"], ["bash", "-c", script, "dmt-train", *job.train_args],
                         _job_env(job))
    trainer["ports"] = [{"name": "pytorchjob-port", "containerPort": MASTER_PORT}]  # the operator's MASTER_PORT

    def replicas(count: int) -> dict:
        return {"replicas": count, "restartPolicy": "OnFailure",
                "template": {"spec": {k: v for k, v in _pod_spec(job, [trainer]).items() if k != "restartPolicy"}}}

    specs = {"Master": replicas(1)}
    if job.nodes > 1:
        specs["Worker"] = replicas(job.nodes - 1)
    return [{"apiVersion": API_VERSIONS["PyTorchJob"], "kind": "PyTorchJob", "metadata": _metadata(job), "spec": {
        "nprocPerNode": str(job.per_node),
        "runPolicy": {"backoffLimit": job.recipe.training.max_restarts, "cleanPodPolicy": "None"},
        "pytorchReplicaSpecs": specs}}]


RENDERERS = {"trainjob": trainjob, "jobset": jobset, "pytorchjob": pytorchjob}


def render_documents(job: K8sJob, kind: str) -> list[dict]:
    """The kind's documents; with a ComputeDomain first, and its channel claimed by every pod, where the plan's
    NVLink domain spans nodes (toolkit/generate/k8s/nvlink.py)."""
    if kind not in RENDERERS:
        raise UserInputError("--kind", f"'{kind}': use one of {', '.join(KINDS)}")
    documents = RENDERERS[kind](job)
    if not nvlink.needs_compute_domain(job.plan, job.gpus):
        return documents
    template = nvlink.channel_template(job.name)
    nvlink.claim_channel(documents, template)
    for document in documents:  # the Trainer sets the node container's resources from resourcesPerNode
        if document["kind"] == "TrainJob":
            document["spec"]["trainer"]["resourcesPerNode"]["claims"] = [{"name": nvlink.CLAIM}]
    return [nvlink.compute_domain(job.name, _metadata(job, plan=False), job.nodes), *documents]


def manifest_text(job: K8sJob, kind: str) -> str:
    """The manifest as one YAML stream, each document written by the safe dumper (every value quoted as YAML needs:
    nothing a name holds can start a key or a document)."""
    # each document its own plain data (json's copy): a value shared by two containers must not become a YAML alias
    documents = json.loads(json.dumps(render_documents(job, kind)))
    header = (f"# Generated by dm-toolkit (dmt k8s render, dmt generate) for recipe {job.recipe.name}: "
              f"{job.nodes} node(s) x {job.per_node} process(es), {job.plan.backend} backend, as a {documents[-1]['kind']}.\n"
              f"# Check it with `dmt validate FILE`, submit it with `kubectl apply -f FILE`.\n")
    return header + "---\n".join(yaml_text(doc, sort_keys=False, width=2**16) for doc in documents)
