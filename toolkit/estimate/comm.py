"""Collective costs with a bandwidth + latency model, and which link tier a parallel group runs over.

Bus-bandwidth factors are those of nccl-tests (doc/PERFORMANCE.md): a ring all-reduce of S bytes over n ranks moves
2(n-1)/n x S per rank, all-gather and reduce-scatter (n-1)/n x S (S = the full, gathered size), broadcast and
point-to-point S. Time = factor x S / busbw + steps x latency.
"""

from __future__ import annotations

from dataclasses import dataclass

# Per-step latency of one ring hop (NCCL, small messages): NVLink ~ 5 us, InfiniBand ~ 10 us.
INTRA_NODE_LATENCY_S = 5e-6
INTER_NODE_LATENCY_S = 10e-6
# Fraction of the link's unidirectional datasheet bandwidth NCCL reaches as bus bandwidth at large sizes
# (nccl-tests all_reduce on H100 NVSwitch: ~360-480 GB/s busbw of 450 GB/s; on 400G IB ~ 45-48 of 50 GB/s).
ACHIEVABLE_BUS_FRACTION = 0.8

BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "p2p": lambda n: 1.0,
}
LATENCY_STEPS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,
    "broadcast": lambda n: n - 1,
    "p2p": lambda n: 1,
}


@dataclass(frozen=True)
class Link:
    """Bus bandwidth (bytes/s) and per-step latency of the slowest tier a group crosses."""

    bus_bw: float
    latency_s: float


@dataclass(frozen=True)
class Network:
    """Per-GPU link speeds of a cluster (GB/s, unidirectional) and its node size."""

    intra_node_bw_gbps: float
    inter_node_bw_gbps: float
    gpus_per_node: int
    # the tiers ("intra", "inter") whose bandwidth is nccl-tests-style busbw measured by `dmt health`, used as it is;
    # the others are datasheet numbers, of which NCCL reaches ACHIEVABLE_BUS_FRACTION
    measured: frozenset[str] = frozenset()

    @classmethod
    def from_catalogue(cls, gpu, gpus_per_node: int) -> "Network":
        """The datasheet links of a catalogue GPU (toolkit/presets/gpus.yaml); `dmt plan` flags may override them."""
        return cls(gpu.intra_node_bw_gbps, gpu.inter_node_bw_gbps, gpus_per_node)

    def link(self, group_size: int, stride: int) -> Link:
        """The link of a group of `group_size` ranks `stride` apart in rank order (Megatron: tp, cp, ep, dp, pp)."""
        span = group_size * stride
        crosses_nodes = group_size > 1 and (span > self.gpus_per_node or stride >= self.gpus_per_node)
        tier = "inter" if crosses_nodes else "intra"
        factor = 1.0 if tier in self.measured else ACHIEVABLE_BUS_FRACTION
        if crosses_nodes:
            return Link(self.inter_node_bw_gbps * 1e9 * factor, INTER_NODE_LATENCY_S)
        return Link(self.intra_node_bw_gbps * 1e9 * factor, INTRA_NODE_LATENCY_S)


def collective_time(op: str, size_bytes: float, group_size: int, link: Link) -> float:
    """Seconds for one collective of `size_bytes` (full size) over `group_size` ranks."""
    if group_size <= 1 or size_bytes <= 0:
        return 0.0
    return BUS_FACTOR[op](group_size) * size_bytes / link.bus_bw + LATENCY_STEPS[op](group_size) * link.latency_s
