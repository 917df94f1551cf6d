"""The operators' files vendored under crds/ (package data; scripts/vendor_crds.py writes them): each CRD's
openAPIV3Schema as JSON (Kubeflow Trainer's, JobSet's, and NVIDIA's DRA driver's ComputeDomain), the stock
torch-distributed ClusterTrainingRuntime as YAML, and sources.json with the repository, release and commit of each."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

CRDS = Path(__file__).resolve().parent / "crds"
# (apiVersion, kind) -> the vendored CRD
SCHEMAS = {("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainjob.json",
           ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime"): "trainingruntime.json",
           ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"): "clustertrainingruntime.json",
           ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset.json",
           ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob.json",
           ("resource.nvidia.com/v1beta1", "ComputeDomain"): "computedomain.json"}
STOCK_RUNTIME = "torch_distributed.yaml"


@functools.cache
def sources() -> dict:
    return json.loads((CRDS / "sources.json").read_text())


def release(file_name: str) -> str:
    """`kubeflow/trainer v2.3.0 (658725bdae)`: where a vendored file comes from, for messages."""
    source = sources()[file_name]
    return f"{source['repository'].removeprefix('github.com/')} {source['release']} ({source['commit'][:10]})"


@functools.cache
def _crd(file_name: str) -> dict:
    return json.loads((CRDS / file_name).read_text())


def crd(file_name: str) -> dict:
    """A vendored CRD: group, kind, version and its openAPIV3Schema (descriptions dropped)."""
    return _crd(file_name)


def stock_runtime() -> dict:
    """Kubeflow Trainer's torch-distributed ClusterTrainingRuntime, as its manifests ship it (a fresh copy)."""
    import yaml

    return copy.deepcopy(yaml.safe_load((CRDS / STOCK_RUNTIME).read_text()))
