"""Multi-node NVLink on Kubernetes: NVIDIA's DRA driver (NVIDIA/k8s-dra-driver-gpu, CRD vendored in crds/) joins the
nodes of a job to one IMEX domain through a ComputeDomain, whose driver creates a ResourceClaimTemplate for its
channel; every pod claims that channel, and its containers list the claim, so NCCL can map peers' memory over NVLink
across nodes. Rendered for a plan whose NVLink domain spans nodes (an NVL72 rack), as the driver's own examples do it
(demo/specs/imex/nvbandwidth-test-job-1.yaml at v25.12.0)."""

from __future__ import annotations

from toolkit.generate.launch import spans_nodes_on_nvlink

API_VERSION = "resource.nvidia.com/v1beta1"
KIND = "ComputeDomain"
CLAIM = "nvlink-channel"  # the name each pod gives its claim on the ComputeDomain's channel


def needs_compute_domain(plan, gpus: bool) -> bool:
    """GPU pods of a plan whose ranks on different nodes share an NVLink domain."""
    return gpus and spans_nodes_on_nvlink(plan)


def channel_template(job_name: str) -> str:
    """The ResourceClaimTemplate the DRA driver creates for the ComputeDomain's channel (the pods claim it)."""
    return f"{job_name}-nvlink-channel"


def compute_domain(job_name: str, metadata: dict, nodes: int) -> dict:
    """The ComputeDomain of the job's nodes. numNodes: the job's nodes (the CRD's description: with the driver's
    default IMEXDaemonsWithDNSNames it only marks the domain Ready; without, it gates the pods until that many
    nodes joined)."""
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {**metadata, "name": f"{job_name}-nvlink"},
            "spec": {"numNodes": nodes, "channel": {"resourceClaimTemplate": {"name": channel_template(job_name)}}}}


def claim_channel(document, template: str) -> None:
    """Every pod spec under `document` claims the channel, and each of its containers (the preflight's NCCL check
    too) lists the claim."""
    if isinstance(document, list):
        for item in document:
            claim_channel(item, template)
        return
    if not isinstance(document, dict):
        return
    if isinstance(document.get("containers"), list):  # a PodSpec
        document["resourceClaims"] = [{"name": CLAIM, "resourceClaimTemplateName": template}]
        for container in document["containers"] + document.get("initContainers", []):
            resources = container.setdefault("resources", {})
            resources["claims"] = [{"name": CLAIM}]
        return
    for value in document.values():
        claim_channel(value, template)
