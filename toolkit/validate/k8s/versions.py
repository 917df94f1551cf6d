"""What changed between the operators' releases, so that a manifest written for another release is told which
release its field belongs to and what this one has instead (rather than "unknown field").

From kubeflow/trainer's history of manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml:
- v2.0.0: spec.podSpecOverrides; spec.labels / spec.annotations; trainer.numProcPerNode int-or-string ("auto"),
  and mlPolicy.torch.numProcPerNode in the runtimes;
- v2.1.0: podSpecOverrides renamed spec.podTemplateOverrides (d56715cea3, PR #2785);
- v2.2.0: podTemplateOverrides replaced by spec.runtimePatches (38d8243cf3, PR #3309), spec.labels / annotations
  gone with it; numProcPerNode an integer and gone from the torch runtime policy (e6b837621a, PR #3239: the
  snapshot shows this in v2.2.0, a release earlier than the issue's "v2.3");
- v2.3.0: mlPolicy.torch.envInjection (PET_* variables in named init or sidecar containers).
"""

from __future__ import annotations

from toolkit.generate.k8s.vendored import SCHEMAS, release

# (kind, dotted key) -> (the releases that had it, what the vendored release has instead)
RETIRED_FIELDS = {
    ("TrainJob", "spec.podSpecOverrides"): ("Trainer v2.0 (renamed podTemplateOverrides in v2.1)",
                                            "spec.runtimePatches (since v2.2)"),
    ("TrainJob", "spec.podTemplateOverrides"): ("Trainer v2.1 (replaced by runtimePatches in v2.2)",
                                                "spec.runtimePatches (since v2.2)"),
    ("TrainJob", "spec.labels"): ("Trainer v2.0-v2.1", "spec.runtimePatches[].trainingRuntimeSpec.template.metadata"),
    ("TrainJob", "spec.annotations"): ("Trainer v2.0-v2.1",
                                       "spec.runtimePatches[].trainingRuntimeSpec.template.metadata"),
    ("TrainingRuntime", "spec.mlPolicy.torch.numProcPerNode"): ("Trainer v2.0-v2.1",
                                                                "the TrainJob's spec.trainer.numProcPerNode"),
    ("ClusterTrainingRuntime", "spec.mlPolicy.torch.numProcPerNode"): ("Trainer v2.0-v2.1",
                                                                       "the TrainJob's spec.trainer.numProcPerNode"),
}


def _get(document: dict, dotted: str):
    value = document
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def version_problems(document: dict) -> list[tuple[str, str]]:
    """(dotted key, message) for what belongs to another release than the vendored one: the apiVersion of a known
    kind, a field that was renamed or removed, numProcPerNode in its old int-or-string form."""
    kind, api = document.get("kind"), document.get("apiVersion")
    served = {k: (v, f) for (v, k), f in SCHEMAS.items()}
    if kind in served and api != served[kind][0]:
        version, file_name = served[kind]
        return [("apiVersion", f"{api!r}: a {kind} is {version} ({release(file_name)})")]
    if kind not in served:
        return []
    this = release(served[kind][1])
    problems = []
    for (field_kind, dotted), (then, now) in RETIRED_FIELDS.items():
        if field_kind == kind and _get(document, dotted) is not None:
            problems.append((dotted, f"is {then}'s field; this {kind} is {this}, which has {now}"))
    procs = _get(document, "spec.trainer.numProcPerNode")
    if kind == "TrainJob" and isinstance(procs, str):
        problems.append(("spec.trainer.numProcPerNode", f"{procs!r} is the int-or-string of Trainer v2.0-v2.1; this "
                                                        f"TrainJob is {this}, where it is an integer: the processes "
                                                        f"per node"))
    return problems
