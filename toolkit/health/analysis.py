"""Localise a problem from measurements: stragglers, slow ring links, the rank or node behind them, odd settings."""

from __future__ import annotations

import statistics


def _median_of_others(values: list[float], index: int) -> float | None:
    others = values[:index] + values[index + 1 :]
    return statistics.median(others) if others else None


def find_stragglers(matmul_ms: list[float], hosts: list[str], factor: float) -> list[dict]:
    """Ranks whose matmul time is more than `factor` x the median time of the other ranks.

    Against the others' median (not everyone's) so that with two ranks the slow one is still named.
    """
    stragglers = []
    for rank, ms in enumerate(matmul_ms):
        median = _median_of_others(matmul_ms, rank)
        if median and ms > factor * median:
            stragglers.append({"rank": rank, "host": hosts[rank], "matmul_ms": ms, "others_median_ms": median,
                               "ratio": ms / median})
    return stragglers


def link_tier(hosts: list[str], src: int, dst: int) -> str:
    return "intra" if hosts[src] == hosts[dst] else "inter"


def find_slow_links(links: list[dict], hosts: list[str], factor: float,
                    floors: dict[str, float | None] | None = None) -> list[dict]:
    """Ring links below `factor` x the median of the other links of their tier (intra- or inter-node), or below
    their tier's floor in GB/s; inter-node links are never held to intra-node speeds."""
    floors = floors or {}
    slow = []
    for index, link in enumerate(links):
        tier = link_tier(hosts, link["src"], link["dst"])
        peers = [other["gbps"] for i, other in enumerate(links)
                 if i != index and link_tier(hosts, other["src"], other["dst"]) == tier]
        median = statistics.median(peers) if peers else None
        floor = floors.get(tier)
        why = []
        if not link.get("correct", True):
            why.append("wrong data")
        if median and link["gbps"] * factor < median:
            why.append(f"{median / max(link['gbps'], 1e-12):.1f}x below the median of the other {tier}-node links")
        if floor is not None and link["gbps"] < floor:
            why.append(f"below the {tier}-node floor of {floor:g} GB/s")
        if why:
            slow.append({**link, "tier": tier, "median_gbps": median, "why": "; ".join(why)})
    return slow


def find_suspects(links: list[dict], slow: list[dict], hosts: list[str]) -> list[dict]:
    """The rank or node that explains the slow links.

    A rank on two slow links (both of its ring neighbours see it slow) is the suspect rather than either link;
    a node all of whose links of one tier are slow, while that tier is fine elsewhere, is the suspect node
    (its NIC, cable or switch port for inter-node links; its NVLink/NVSwitch or PCIe for intra-node ones).
    """
    slow_pairs = {(s["src"], s["dst"]) for s in slow}
    suspects = []
    if len(hosts) > 2:
        for rank in range(len(hosts)):
            on = [pair for pair in slow_pairs if rank in pair]
            if len(on) >= 2:
                suspects.append({"rank": rank, "host": hosts[rank], "why": "both of its ring links are slow"})
    for tier in ("intra", "inter"):
        tier_links = [(link["src"], link["dst"]) for link in links if link_tier(hosts, link["src"], link["dst"]) == tier]
        if not tier_links or all(pair in slow_pairs for pair in tier_links):
            continue  # nothing slow, or everything slow: no single node to blame
        for host in dict.fromkeys(hosts):
            mine = [pair for pair in tier_links if hosts[pair[0]] == host or hosts[pair[1]] == host]
            if mine and all(pair in slow_pairs for pair in mine):
                suspects.append({"rank": None, "host": host, "why": f"all of its {tier}-node links are slow"})
    return suspects


def find_slow_nodes(per_host_busbw: dict[str, float], factor: float, floor: float | None) -> list[dict]:
    """Nodes whose intra-node all_reduce busbw is below the floor or `factor` x below the other nodes' median."""
    names = list(per_host_busbw)
    values = [per_host_busbw[name] for name in names]
    slow = []
    for index, name in enumerate(names):
        median = _median_of_others(values, index)
        if (floor is not None and values[index] < floor) or (median and values[index] * factor < median):
            slow.append({"host": name, "busbw_gbps": values[index], "others_median_gbps": median, "floor_gbps": floor})
    return slow


def env_differences(ranks: list[dict]) -> list[str]:
    """One line per NCCL_*/TORCH_NCCL_*/... variable set differently across ranks (a classic cause of hangs)."""
    lines = []
    keys = sorted({key for facts in ranks for key in facts.get("env", {})})
    for key in keys:
        values: dict[str | None, list[int]] = {}
        for rank, facts in enumerate(ranks):
            values.setdefault(facts.get("env", {}).get(key), []).append(rank)
        if len(values) > 1 and key not in ("CUDA_VISIBLE_DEVICES",):  # per-rank GPU masks differ by design
            shown = ", ".join(f"{value!r} on ranks {_ranges(members)}" for value, members in values.items())
            lines.append(f"{key} differs across ranks: {shown}")
    return lines


def _ranges(ranks: list[int]) -> str:
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def numa_mismatch(facts: dict) -> str | None:
    """A rank bound to CPUs of other NUMA nodes than its GPU's pays a cross-socket hop on every host<->GPU copy."""
    gpu_node, cpu_nodes = facts.get("gpu_numa_node"), facts.get("numa_nodes")
    if gpu_node is None or gpu_node < 0 or not cpu_nodes or facts.get("numa_node_count", 0) <= 1:
        return None
    if gpu_node not in cpu_nodes:
        return f"CPUs bound to NUMA node(s) {cpu_nodes} but its GPU sits on NUMA node {gpu_node}"
    return None
