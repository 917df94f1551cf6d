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
    # the tiers this command was given figures for (flags, a health report): a calibration's do not replace them
    given: frozenset[str] = frozenset()

    @classmethod
    def from_catalogue(cls, gpu, gpus_per_node: int) -> "Network":
        """The datasheet links of a catalogue GPU (toolkit/presets/gpus.yaml); `dmt plan` flags may override them."""
        return cls(gpu.intra_node_bw_gbps, gpu.inter_node_bw_gbps, gpus_per_node)

    def with_measured(self, intra: float | None = None, inter: float | None = None) -> "Network":
        """Measured bus bandwidths (GB/s) in place of the tiers' figures, except on tiers given for this command."""
        import dataclasses

        changes, measured = {}, set(self.measured)
        for tier, value in (("intra", intra), ("inter", inter)):
            if value is not None and tier not in self.given:
                changes[f"{tier}_node_bw_gbps"] = value
                measured.add(tier)
        return dataclasses.replace(self, **changes, measured=frozenset(measured)) if changes else self

    def link(self, group_size: int, stride: int) -> Link:
        """The ring link of a group of `group_size` ranks `stride` apart in rank order (Megatron: tp, cp, ep, dp, pp).

        A group that spans nodes with several of its ranks on each node runs NCCL's rings through all of those
        ranks' NICs at once (one channel per NIC), so its bus bandwidth is the per-GPU network share times the
        group's ranks per node, up to the NVLink rate every rank also moves the data at: nccl-tests all_reduce
        across H100 nodes with 8 x 400G NDR reaches 400-450 GB/s busbw, against 50 GB/s per GPU (cluster
        validation figures, e.g. saturncloud.io/blog/crusoe-nccl-cluster-validation). A group with one rank per
        node (stride >= gpus_per_node) has that rank's NIC only."""
        intra = self._bandwidth("intra", self.intra_node_bw_gbps)
        if not self.crosses_nodes(group_size, stride):
            return Link(intra, INTRA_NODE_LATENCY_S)
        return Link(min(intra, self.ranks_per_node(group_size, stride) * self.nic()), INTER_NODE_LATENCY_S)

    def crosses_nodes(self, group_size: int, stride: int) -> bool:
        return group_size > 1 and (group_size * stride > self.gpus_per_node or stride >= self.gpus_per_node)

    def ranks_per_node(self, group_size: int, stride: int) -> int:
        return max(1, min(group_size, self.gpus_per_node // stride))

    def nic(self) -> float:
        """One GPU's network bus bandwidth in bytes/s (`dmt health` measures it with one rank per node)."""
        return self._bandwidth("inter", self.inter_node_bw_gbps)

    def _bandwidth(self, tier: str, gbps: float) -> float:
        return gbps * 1e9 * (1.0 if tier in self.measured else ACHIEVABLE_BUS_FRACTION)

    def all_to_all_time(self, size_bytes: float, group_size: int, stride: int) -> float:
        """Seconds for an all-to-all of `size_bytes` per rank over `group_size` ranks `stride` apart. Each rank sends
        (n-1)/n of its data; when the group spans nodes only the share addressed to other nodes crosses the network
        (NCCL's all-to-all sends to ranks on the same node over NVLink, to the others through the GPU's own NIC, at
        the same time), so the slower of the two sets the time."""
        if group_size <= 1 or size_bytes <= 0:
            return 0.0
        if not self.crosses_nodes(group_size, stride):
            return collective_time("all_to_all", size_bytes, group_size, self.link(group_size, stride))
        local = self.ranks_per_node(group_size, stride)
        remote = (group_size - local) / group_size * size_bytes / self.nic()  # through this GPU's own NIC
        near = (local - 1) / group_size * size_bytes / self.link(local, stride).bus_bw if local > 1 else 0.0
        return max(remote, near) + LATENCY_STEPS["all_to_all"](group_size) * INTER_NODE_LATENCY_S

def collective_time(op: str, size_bytes: float, group_size: int, link: Link) -> float:
    """Seconds for one collective of `size_bytes` (full size) over `group_size` ranks."""
    if group_size <= 1 or size_bytes <= 0:
        return 0.0
    return BUS_FACTOR[op](group_size) * size_bytes / link.bus_bw + LATENCY_STEPS[op](group_size) * link.latency_s
