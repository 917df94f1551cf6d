"""The multi-node NVLink rules of a manifest (toolkit/generate/k8s/nvlink.py renders them): a plan whose NVLink domain
spans nodes needs a ComputeDomain of the job's nodes, and every pod must claim its channel in each container, or NCCL
finds no IMEX channel and crosses nodes over the network at a fraction of the NVLink rate the plan was priced at."""

from __future__ import annotations

from toolkit.generate.k8s.nvlink import KIND, needs_compute_domain
from toolkit.validate import Problem


def _pod_specs(node, path: str):
    """(dotted key, PodSpec) of every pod template under `node`."""
    if isinstance(node, list):
        for index, item in enumerate(node):
            yield from _pod_specs(item, f"{path}[{index}]")
    elif isinstance(node, dict):
        if isinstance(node.get("containers"), list):
            yield path, node
            return
        for key, value in node.items():
            yield from _pod_specs(value, f"{path}.{key}" if path else key)


def nvlink_problems(documents: list[dict], plan, accelerator: str | None, nodes) -> list[Problem]:
    """Where the plan's ranks on different nodes share an NVLink domain: the ComputeDomain and the pods' claims."""
    if plan is None or not needs_compute_domain(plan, accelerator != "cpu"):
        return []
    domains = [d for d in documents if d.get("kind") == KIND]
    if not domains:
        return [Problem("FILE", f"the plan's NVLink domain ({plan.nvlink_domain} GPUs) spans nodes of "
                                f"{plan.gpus_per_node}: add the DRA driver's {KIND} (resource.nvidia.com/v1beta1) and "
                                f"claim its channel in every pod (dmt k8s render does)")]
    domain = domains[0]
    label = f"{KIND} {domain.get('metadata', {}).get('name')}"
    spec = domain.get("spec") or {}
    problems = []
    if isinstance(nodes, int) and spec.get("numNodes") not in (0, nodes):
        problems.append(Problem(f"{label}: spec.numNodes", f"{spec.get('numNodes')!r}, but the job runs on {nodes} "
                                                           f"nodes"))
    template = ((spec.get("channel") or {}).get("resourceClaimTemplate") or {}).get("name")
    for document in documents:
        if document is domain or document.get("kind") == KIND:
            continue
        where = f"{document.get('kind')} {document.get('metadata', {}).get('name')}"
        for key, pod in _pod_specs(document.get("spec"), "spec"):
            claims = {c.get("name") for c in pod.get("resourceClaims") or [] if isinstance(c, dict)
                      and c.get("resourceClaimTemplateName") == template}
            if not claims:
                problems.append(Problem(f"{where}: {key}.resourceClaims", f"claims no channel of {label} (its "
                                                                           f"resourceClaimTemplate {template!r})"))
                continue
            for index, container in enumerate(pod.get("containers") or []):
                listed = {c.get("name") for c in (container.get("resources") or {}).get("claims") or []}
                if not claims & listed:
                    problems.append(Problem(f"{where}: {key}.containers[{index}].resources.claims",
                                            f"lists none of {sorted(claims)}: the container gets no IMEX channel"))
    return problems
