"""Re-vendor the Kubernetes CRD schemas under toolkit/generate/k8s/crds/ from the operators' own repositories.

    python scripts/vendor_crds.py TRAINER_GIT_DIR JOBSET_GIT_DIR [DRA_DRIVER_GIT_DIR]

Each CRD's openAPIV3Schema is read at the release tag below with `git show`, its `description` texts dropped (they are
a third of a megabyte per CRD and validation never reads them), and written as JSON beside sources.json, which records
the repository, release, commit and path of every file. The torch-distributed ClusterTrainingRuntime is copied as it
is. Data only: no code of the operators is vendored. A repository whose directory is not given (or is "-") keeps
the files vendored from it before.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parent.parent / "toolkit" / "generate" / "k8s" / "crds"
TRAINER, PYTORCHJOB, JOBSET = "v2.3.0", "v1.9.4", "v0.12.0"  # Trainer's current release; the last with PyTorchJob
DRA_DRIVER = "v25.12.0"  # NVIDIA's DRA driver for GPUs: ComputeDomain (multi-node NVLink), resource.nvidia.com/v1beta1
# (repository key, tag, path in the repository, vendored file name)
FILES = (
    ("kubeflow/trainer", TRAINER, "manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml", "trainjob.json"),
    ("kubeflow/trainer", TRAINER, "manifests/base/crds/trainer.kubeflow.org_trainingruntimes.yaml",
     "trainingruntime.json"),
    ("kubeflow/trainer", TRAINER, "manifests/base/crds/trainer.kubeflow.org_clustertrainingruntimes.yaml",
     "clustertrainingruntime.json"),
    ("kubeflow/trainer", PYTORCHJOB, "manifests/base/crds/kubeflow.org_pytorchjobs.yaml", "pytorchjob.json"),
    ("kubernetes-sigs/jobset", JOBSET, "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml", "jobset.json"),
    ("kubeflow/trainer", TRAINER, "manifests/base/runtimes/torch_distributed.yaml", "torch_distributed.yaml"),
    ("NVIDIA/k8s-dra-driver-gpu", DRA_DRIVER,
     "deployments/helm/nvidia-dra-driver-gpu/crds/resource.nvidia.com_computedomains.yaml", "computedomain.json"),
)


def _git(directory: str, *args: str) -> str:
    return subprocess.run(["git", "-C", directory, *args], check=True, capture_output=True, text=True).stdout


def _without_descriptions(node):
    if isinstance(node, dict):
        return {k: _without_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_without_descriptions(v) for v in node]
    return node


def main(trainer_dir: str, jobset_dir: str, dra_driver_dir: str = "-") -> None:
    directories = {"kubeflow/trainer": trainer_dir, "kubernetes-sigs/jobset": jobset_dir,
                   "NVIDIA/k8s-dra-driver-gpu": dra_driver_dir}
    sources = json.loads((OUT / "sources.json").read_text())
    for repo, tag, path, name in FILES:
        directory = directories[repo]
        if directory == "-":
            continue
        text = _git(directory, "show", f"{tag}:{path}")
        sources[name] = {"repository": f"github.com/{repo}", "release": tag,
                         "commit": _git(directory, "rev-list", "-n", "1", tag).strip(), "path": path,
                         "blob": _git(directory, "rev-parse", f"{tag}:{path}").strip()}
        if name.endswith(".yaml"):
            (OUT / name).write_text(text)
            continue
        crd = yaml.safe_load(text)
        (version,) = crd["spec"]["versions"]  # each of these CRDs serves one version
        document = {"group": crd["spec"]["group"], "kind": crd["spec"]["names"]["kind"], "version": version["name"],
                    "openAPIV3Schema": _without_descriptions(version["schema"]["openAPIV3Schema"])}
        (OUT / name).write_text(json.dumps(document, separators=(",", ":"), sort_keys=True) + "\n")
    (OUT / "sources.json").write_text(json.dumps(sources, indent=2) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
