"""`dmt validate FILE.yaml` for Kubernetes manifests: each document against its operator's release (versions.py), its
CRD's schema and CEL rules (schemas.py), then the plan's own rules: nodes x processes per node = the plan's world size,
GPU requests and limits equal to the processes per node, a memory-backed /dev/shm large enough for the plan's
communicators, no PET_* variable set by hand in a TrainJob, the image and the checkpoint PVC named.

The plan is the one `dmt k8s render` recorded in the manifest (render.PLAN_ANNOTATION); a hand-written manifest has
none and is checked against --world-size alone."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from toolkit.errors import UserInputError
from toolkit.generate.k8s import names
from toolkit.generate.k8s.render import (
    CONTAINER,
    GPU_RESOURCE,
    PET_VARIABLES,
    PLAN_ANNOTATION,
    SHM_MOUNT,
)
from toolkit.generate.k8s.shm import quantity, quantity_bytes, shm_bytes
from toolkit.readers import unique_keys
from toolkit.spec.plan import Plan, validated
from toolkit.validate import Problem
from toolkit.validate.k8s.nvlink import nvlink_problems
from toolkit.validate.k8s.schemas import cel_problems, crd_file, schema_problems
from toolkit.validate.k8s.versions import version_problems

JOB_KINDS = ("TrainJob", "JobSet", "PyTorchJob")


@dataclass
class TrainingPod:
    """What the plan's rules read of a job, wherever its kind keeps it (each value with the key it came from)."""

    kind: str
    nodes: tuple[str, object]
    per_node: tuple[str, object]
    resources: tuple[str, dict]
    image: tuple[str, object]
    env: list[tuple[str, list]] = field(default_factory=list)
    volumes: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)
    where: str = ""  # the key of the training container, for messages about mounts


def is_manifest(documents: list) -> bool:
    """Whether a YAML file's documents are Kubernetes objects (apiVersion and kind), not an accelerate.yaml or a
    megatron.yaml."""
    return bool(documents) and all(isinstance(d, dict) and "apiVersion" in d and "kind" in d for d in documents)


def _dig(value, *keys, default=None):
    for key in keys:
        if isinstance(key, int):
            value = value[key] if isinstance(value, list) and len(value) > key else None
        else:
            value = value.get(key) if isinstance(value, dict) else None
    return default if value is None else value


def _named(items, name: str) -> tuple[int, dict] | tuple[None, None]:
    for index, item in enumerate(items if isinstance(items, list) else []):
        if isinstance(item, dict) and item.get("name") == name:
            return index, item
    return None, None


def _trainjob(job: dict, documents: list[dict]) -> TrainingPod:
    trainer = _dig(job, "spec", "trainer", default={})
    ref = _dig(job, "spec", "runtimeRef", default={})
    runtime = next((d for d in documents if d.get("kind") == ref.get("kind") and
                    _dig(d, "metadata", "name") == ref.get("name")), None)
    pod = TrainingPod("TrainJob", ("spec.trainer.numNodes", trainer.get("numNodes", _dig(
        runtime, "spec", "mlPolicy", "numNodes", default=1))), ("spec.trainer.numProcPerNode",
        trainer.get("numProcPerNode")), ("spec.trainer.resourcesPerNode", trainer.get("resourcesPerNode") or {}),
        ("spec.trainer.image", trainer.get("image")), [("spec.trainer.env", trainer.get("env") or [])])
    node = CONTAINER["trainjob"]
    for source, root, prefix in ((runtime, ("spec",), "spec"), *(
            (job, ("spec", "runtimePatches", i, "trainingRuntimeSpec"), f"spec.runtimePatches[{i}].trainingRuntimeSpec")
            for i in range(len(_dig(job, "spec", "runtimePatches", default=[]))))):
        index, replicated = _named(_dig(source, *root, "template", "spec", "replicatedJobs"), node)
        if replicated is None:
            continue
        spec = _dig(replicated, "template", "spec", "template", "spec", default={})
        pod.volumes += spec.get("volumes") or []
        at, container = _named(spec.get("containers"), node)
        if container is not None:
            where = f"{prefix if source is job else runtime['kind']} replicatedJobs[{index}] containers[{at}]"
            pod.mounts += container.get("volumeMounts") or []
            pod.where = pod.where or where
            if source is not job:
                pod.env.append((f"{runtime['kind']} {node} container env", container.get("env") or []))
            if not pod.image[1] and container.get("image"):
                pod.image = (f"{runtime['kind']} {node} container image", container["image"])
    pod.where = pod.where or "the runtime's node container"
    return pod


def _container_pod(kind: str, container_key: str, container: dict, spec: dict, nodes: tuple, per_node: tuple):
    return TrainingPod(kind, nodes, per_node, (f"{container_key}.resources", container.get("resources") or {}),
                       (f"{container_key}.image", container.get("image")), [], spec.get("volumes") or [],
                       container.get("volumeMounts") or [], container_key)


def _count(value):
    """A count as Kubernetes writes it where only strings go (an env value, PyTorchJob's nprocPerNode)."""
    return int(value) if isinstance(value, str) and value.isdigit() else value


def _env_value(container: dict, name: str):
    _, variable = _named(container.get("env"), name)
    return None if variable is None else _count(variable.get("value"))


def _jobset(job: dict, documents: list[dict]) -> TrainingPod:
    jobs = _dig(job, "spec", "replicatedJobs", default=[])
    for index, replicated in enumerate(jobs):
        spec = _dig(replicated, "template", "spec", "template", "spec", default={})
        at, container = _named(spec.get("containers"), CONTAINER["jobset"])
        if container is None:
            continue
        key = f"spec.replicatedJobs[{index}].template.spec.template.spec.containers[{at}]"
        pods = _dig(replicated, "replicas", default=1) * _dig(replicated, "template", "spec", "parallelism", default=1)
        return _container_pod("JobSet", key, container, spec, (f"spec.replicatedJobs[{index}] replicas x parallelism",
                              pods), (f"{key}.env PET_NPROC_PER_NODE", _env_value(container, "PET_NPROC_PER_NODE")))
    raise _no_container("JobSet", "spec.replicatedJobs[*]", CONTAINER["jobset"])


def _pytorchjob(job: dict, documents: list[dict]) -> TrainingPod:
    specs = _dig(job, "spec", "pytorchReplicaSpecs", default={})
    replicas = sum(_dig(spec, "replicas", default=1) for spec in specs.values() if isinstance(spec, dict))
    for role in ("Master", "Worker"):
        spec = _dig(specs, role, "template", "spec", default={})
        at, container = _named(spec.get("containers"), CONTAINER["pytorchjob"])
        if container is not None:
            key = f"spec.pytorchReplicaSpecs.{role}.template.spec.containers[{at}]"
            return _container_pod("PyTorchJob", key, container, spec, ("spec.pytorchReplicaSpecs replicas", replicas),
                                  ("spec.nprocPerNode", _count(_dig(job, "spec", "nprocPerNode"))))
    raise _no_container("PyTorchJob", "spec.pytorchReplicaSpecs", CONTAINER["pytorchjob"])


class _NoContainer(Exception):
    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key, self.message = key, message


def _no_container(kind: str, key: str, name: str) -> _NoContainer:
    return _NoContainer(key, f"no container named '{name}', the one the {kind} operator runs training in")


def _recorded_plan(job: dict, world_size: int | None) -> tuple[object, str | None, list[Problem]]:
    """The plan `dmt k8s render` recorded in the manifest (with the accelerator), or None for a hand-written one."""
    text = _dig(job, "metadata", "annotations", PLAN_ANNOTATION)
    if text is None:
        if world_size is None:
            return None, None, [Problem("metadata.annotations", f"no {PLAN_ANNOTATION} (the plan `dmt k8s render` "
                                                                f"records): pass --world-size N to check it against")]
        return None, None, []
    try:
        record = json.loads(text, object_pairs_hook=unique_keys)
        plan = validated(Plan, record["plan"])
        accelerator = record.get("accelerator")
    except (ValueError, KeyError, TypeError, UserInputError) as exc:
        return None, None, [Problem(f"metadata.annotations.{PLAN_ANNOTATION}", f"is not a plan `dmt k8s render` "
                                                                               f"wrote ({exc}); render it again")]
    return plan, accelerator, []


def plan_problems(pod: TrainingPod, plan, accelerator: str | None, world_size: int | None) -> list[Problem]:
    problems = []
    (nodes_key, nodes), (procs_key, procs) = pod.nodes, pod.per_node
    world = plan.gpus if plan is not None else world_size
    if plan is not None and world_size is not None and world_size != plan.gpus:
        problems.append(Problem("--world-size", f"{world_size}, but the manifest's plan runs {plan.gpus} processes"))
    if not isinstance(procs, int) or isinstance(procs, bool) or procs < 1:
        problems.append(Problem(procs_key, f"{procs!r}: must be the processes per node, a positive integer"
                                           + (f" ({world} processes over {nodes} node(s))" if world else "")))
        procs = None
    elif isinstance(nodes, int) and world is not None and nodes * procs != world:
        problems.append(Problem(procs_key, f"{nodes} node(s) ({nodes_key}) x {procs} processes = {nodes * procs}, "
                                           f"but the plan's world size is {world}"))
    problems += _gpu_problems(pod, procs, accelerator)
    problems += _shm_problems(pod, plan, procs)
    if pod.kind == "TrainJob":
        for key, env in pod.env:
            owned = sorted({v.get("name") for v in env if isinstance(v, dict)} & set(PET_VARIABLES))
            if owned:
                problems.append(Problem(key, f"sets {', '.join(owned)} by hand: the Trainer's torch runtime injects "
                                             f"the PET_* variables and refuses a TrainJob that sets them"))
    image_key, image = pod.image
    if not isinstance(image, str) or not names.IMAGE.fullmatch(image):
        problems.append(Problem(image_key, f"{image!r}: name the container image that holds the toolkit"))
    claims = {v.get("name"): v["persistentVolumeClaim"].get("claimName") for v in pod.volumes
              if isinstance(v, dict) and isinstance(v.get("persistentVolumeClaim"), dict)}
    if not any(claims.get(m.get("name")) for m in pod.mounts if isinstance(m, dict)):
        problems.append(Problem(f"{pod.where}.volumeMounts", "no checkpoint PersistentVolumeClaim mounted: a restarted "
                                                              "pod would find no checkpoint to resume from"))
    return problems


def _gpu_problems(pod: TrainingPod, procs: int | None, accelerator: str | None) -> list[Problem]:
    key, resources = pod.resources
    asked = {section: _dig(resources, section, GPU_RESOURCE) for section in ("requests", "limits")}
    if accelerator == "cpu":
        wrong = [section for section, count in asked.items() if count not in (None, 0, "0")]
        return [Problem(f"{key}.{' and '.join(wrong)}", f"asks for {asked[wrong[0]]} {GPU_RESOURCE}; the plan trains "
                                                        f"on CPU")] if wrong else []
    if procs is None or (accelerator != "gpu" and asked == {"requests": None, "limits": None}):
        return []
    wrong = [section for section, count in asked.items() if quantity_bytes("" if count is None else count) != procs]
    if not wrong:
        return []
    return [Problem(f"{key}.{' and '.join(wrong)}", f"{GPU_RESOURCE} is {asked[wrong[0]]!r}; the plan runs {procs} "
                                                    f"processes per node, one GPU each: set it to {procs}")]


def _shm_problems(pod: TrainingPod, plan, procs: int | None) -> list[Problem]:
    mount = next((m for m in pod.mounts if isinstance(m, dict) and m.get("mountPath") == SHM_MOUNT), None)
    volume = next((v for v in pod.volumes if isinstance(v, dict) and mount and v.get("name") == mount.get("name")),
                  None)
    medium = _dig(volume, "emptyDir", "medium")
    if mount is None or medium != "Memory":
        return [Problem(f"{pod.where}.volumeMounts", f"no memory-backed emptyDir at {SHM_MOUNT}: pods get 64 MB "
                                                     f"there and NCCL wants about 33 MB per communicator")]
    limit = _dig(volume, "emptyDir", "sizeLimit")
    if plan is None or procs is None or limit is None:  # no limit: the pod's memory bounds it
        return []
    needed = shm_bytes(plan, procs)
    size = quantity_bytes(limit)
    if size is None:
        return [Problem(f"volumes.{volume.get('name')}.emptyDir.sizeLimit", f"{str(limit)[:40]!r} is not a "
                                                                            f"Kubernetes quantity the API server "
                                                                            f"stores (e.g. {quantity(needed)})")]
    if size < needed:
        return [Problem(f"volumes.{volume.get('name')}.emptyDir.sizeLimit", f"{limit!r} is less than the "
                                                                            f"{quantity(needed)} the plan's "
                                                                            f"communicators need on {procs} ranks")]
    return []


EXTRACT = {"TrainJob": _trainjob, "JobSet": _jobset, "PyTorchJob": _pytorchjob}  # what each kind's pod reads


def validate_manifest(documents: list[dict], world_size: int | None = None) -> list[Problem]:
    """Every problem of a manifest's documents, each one line: release, schema and CEL per document, then the plan's
    rules for the training job in it."""
    problems: list[Problem] = []
    jobs = []
    for number, document in enumerate(documents, 1):
        label = f"{document.get('kind')} {_dig(document, 'metadata', 'name', default='(unnamed)')}"
        found = [Problem(f"{label}: {key}", message) for key, message in version_problems(document)]
        file_name = crd_file(document)
        if file_name is None and not found:
            found.append(Problem(f"document {number}", f"{document.get('apiVersion')} {document.get('kind')} is none "
                                                       f"of the kinds checked here (TrainJob, TrainingRuntime, "
                                                       f"ClusterTrainingRuntime, JobSet, PyTorchJob, "
                                                       f"ComputeDomain)"))
        if file_name is not None and not found:
            found += [Problem(f"{label}: {key}", message) for key, message in
                      schema_problems(document, file_name) + cel_problems(document, file_name)]
        problems += found
        if document.get("kind") in JOB_KINDS and file_name is not None:
            jobs.append((label, document, bool(found)))
    if not jobs and not problems:
        problems.append(Problem("FILE", f"holds no training job ({', '.join(JOB_KINDS)})"))
    for label, job, broken in jobs:
        if broken:  # its schema problems come first: the plan's rules would read what is not there
            continue
        plan, accelerator, found = _recorded_plan(job, world_size)
        try:
            pod = EXTRACT[job["kind"]](job, documents)
        except _NoContainer as exc:
            problems.append(Problem(f"{label}: {exc.key}", exc.message))
            continue
        problems += [Problem(f"{label}: {p.key}", p.message) for p in found + plan_problems(pod, plan, accelerator,
                                                                                              world_size)]
        problems += nvlink_problems(documents, plan, accelerator, pod.nodes[1])
    return problems

