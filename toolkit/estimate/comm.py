"""Collective costs with a bandwidth + latency model, and which link tier a parallel group runs over.

Bus-bandwidth factors are those of nccl-tests (doc/PERFORMANCE.md): a ring all-reduce of S bytes over n ranks moves
2(n-1)/n x S per rank, all-gather and reduce-scatter (n-1)/n x S (S = the full, gathered size), broadcast and
point-to-point S. Time = factor x S / busbw + steps x latency.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.spec.model import by_identity

# Per-step latency of one ring hop (NCCL, small messages) inside an NVLink domain: ~ 5 us.
INTRA_NODE_LATENCY_S = 5e-6
INTER_NODE_LATENCY_S = 10e-6  # InfiniBand's (SCALE_OUT below)
# Fraction of the link's unidirectional datasheet bandwidth NCCL reaches as bus bandwidth at large sizes
# (nccl-tests all_reduce on H100 NVSwitch: ~360-480 GB/s busbw of 450 GB/s; on 400G IB ~ 45-48 of 50 GB/s).
ACHIEVABLE_BUS_FRACTION = 0.8


@dataclass(frozen=True)
class ScaleOut:
    """A scale-out network tier (`cluster.network`, --network): its per-GPU bandwidth where it is not the catalogue
    GPU's reference NIC, the fraction of it NCCL reaches as bus bandwidth, and one ring hop's latency."""

    bandwidth_gbps: float | None  # None: the GPU's inter_node_bw_gbps (toolkit/presets/gpus.yaml)
    efficiency: float
    latency_s: float


SCALE_OUT = {
    # the reference systems' fabric (DGX/HGX with one NDR/XDR port per GPU): ACHIEVABLE_BUS_FRACTION, 10 us a hop
    "infiniband": ScaleOut(None, ACHIEVABLE_BUS_FRACTION, INTER_NODE_LATENCY_S),
    # RDMA over Converged Ethernet on the same ConnectX NICs and line rate: NCCL drives it through the same verbs
    # transport (net_ib), so the hop latency is modelled as InfiniBand's; NCCL's maintainers called 600 of 800 Gb/s
    # busbw on 8 x 100G RoCE per node "roughly matching our expectation (though lower by a little bit)"
    # (https://github.com/NVIDIA/nccl/issues/495): 0.75
    "roce": ScaleOut(None, 0.75, INTER_NODE_LATENCY_S),
    # Ethernet without RDMA: NCCL's socket transport through the kernel's TCP stack. 25 GB/s per GPU (a 200 GbE port
    # each), the low end of the 25-100 GB/s the project's source documents give Ethernet; 4-6 GB/s busbw of a 12.5 GB/s
    # (100 Gb/s) TCP network is the best NCCL's issue tracker reports after tuning sockets and threads
    # (https://github.com/NVIDIA/nccl/issues/450): 0.4; a hop through the kernel's stack assumed 3x RDMA's latency
    "ethernet": ScaleOut(25.0, 0.4, 30e-6),
}

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
    """Per-GPU link speeds of a cluster (GB/s, unidirectional), its node size, its NVLink domain and its scale-out
    tier. A plan's own topology (gpus_per_node, nvlink_domain, network) replaces these in `for_plan`."""

    intra_node_bw_gbps: float  # inside the NVLink domain
    inter_node_bw_gbps: float  # between domains, the GPU's share of the scale-out network
    gpus_per_node: int
    # the tiers ("intra", "inter") whose bandwidth is nccl-tests-style busbw measured by `dmt health`, used as it is;
    # the others are datasheet numbers, of which NCCL reaches ACHIEVABLE_BUS_FRACTION (inside the domain) or the
    # scale-out tier's efficiency (between domains)
    measured: frozenset[str] = frozenset()
    # the tiers this command was given figures for (flags, a health report): a calibration's do not replace them
    given: frozenset[str] = frozenset()
    nvlink_domain: int | None = None  # GPUs on one NVLink fabric (None: the node)
    scale_out: str = "infiniband"  # SCALE_OUT's key

    @classmethod
    def from_catalogue(cls, gpu, gpus_per_node: int, nvlink_domain: int | None = None,
                       scale_out: str = "infiniband") -> "Network":
        """The datasheet links of a catalogue GPU (toolkit/presets/gpus.yaml); `dmt plan` flags may override them."""
        return cls(gpu.intra_node_bw_gbps, gpu.inter_node_bw_gbps, gpus_per_node, nvlink_domain=nvlink_domain,
                   scale_out=scale_out)

    def for_plan(self, plan) -> "Network":
        """This network as the plan's cluster is shaped: its node size, NVLink domain and scale-out tier. A tier with
        its own default bandwidth (ethernet) caps the catalogue's NIC unless the bandwidth was given or measured.
        One object per shape (step_time asks it of every plan the search times)."""
        return _shaped(self, plan.gpus_per_node, plan.nvlink_domain, plan.network)

    def _shaped(self, gpus_per_node: int, nvlink_domain: int | None, scale_out: str) -> "Network":
        import dataclasses

        inter = self.inter_node_bw_gbps
        default = SCALE_OUT[scale_out].bandwidth_gbps
        if default is not None and "inter" not in self.given | self.measured:
            inter = min(inter, default)
        return dataclasses.replace(self, gpus_per_node=gpus_per_node, nvlink_domain=nvlink_domain,
                                   scale_out=scale_out, inter_node_bw_gbps=inter)

    @property
    def domain(self) -> int:
        """GPUs on one NVLink fabric: the NVL72 rack, or the node."""
        return self.nvlink_domain or self.gpus_per_node

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

        A group inside one NVLink domain (a node, or an NVL72 rack of 18 nodes) runs at NVLink rates. A group that
        spans domains with several of its ranks in each runs NCCL's rings through all of those ranks' NICs at once
        (one channel per NIC), so its bus bandwidth is the per-GPU network share times the group's ranks per domain,
        up to the NVLink rate every rank also moves the data at: nccl-tests all_reduce across H100 nodes with 8 x 400G
        NDR reaches 400-450 GB/s busbw, against 50 GB/s per GPU (cluster validation figures, e.g.
        saturncloud.io/blog/crusoe-nccl-cluster-validation). A group with one rank per domain (stride >= the domain)
        has that rank's NIC only."""
        intra = self._bandwidth("intra", self.intra_node_bw_gbps)
        if not self.crosses_domain(group_size, stride):
            return Link(intra, INTRA_NODE_LATENCY_S)
        return Link(min(intra, self.ranks_per_domain(group_size, stride) * self.nic()),
                    SCALE_OUT[self.scale_out].latency_s)

    def crosses_domain(self, group_size: int, stride: int) -> bool:
        """Whether a group leaves the NVLink domain (Megatron-Core orders ranks tp, cp, ep, dp, pp, so a group of
        `group_size` ranks `stride` apart starting at a domain boundary spans group_size x stride ranks)."""
        return group_size > 1 and (group_size * stride > self.domain or stride >= self.domain)

    def ranks_per_domain(self, group_size: int, stride: int) -> int:
        return max(1, min(group_size, self.domain // stride))

    def nic(self) -> float:
        """One GPU's network bus bandwidth in bytes/s (`dmt health` measures it with one rank per node)."""
        return self._bandwidth("inter", self.inter_node_bw_gbps)

    def _bandwidth(self, tier: str, gbps: float) -> float:
        if tier in self.measured:
            return gbps * 1e9
        return gbps * 1e9 * (ACHIEVABLE_BUS_FRACTION if tier == "intra" else SCALE_OUT[self.scale_out].efficiency)

    def all_to_all_time(self, size_bytes: float, group_size: int, stride: int,
                        remote_bytes: float | None = None) -> float:
        """Seconds for an all-to-all of `size_bytes` per rank over `group_size` ranks `stride` apart. Each rank sends
        (n-1)/n of its data; when the group spans NVLink domains only the share addressed to other domains crosses the
        network (NCCL's all-to-all sends to ranks in the same domain over NVLink, to the others through the GPU's own
        NIC, at the same time), so the slower of the two sets the time. `remote_bytes`: what crosses the network
        when that is not the even share (a hierarchical dispatch that sends a token once per domain)."""
        if group_size <= 1 or size_bytes <= 0:
            return 0.0
        if not self.crosses_domain(group_size, stride):
            return collective_time("all_to_all", size_bytes, group_size, self.link(group_size, stride))
        local = self.ranks_per_domain(group_size, stride)
        if remote_bytes is None:
            remote_bytes = (group_size - local) / group_size * size_bytes
        remote = remote_bytes / self.nic()  # through this GPU's own NIC
        near = (local - 1) / group_size * size_bytes / self.link(local, stride).bus_bw if local > 1 else 0.0
        return max(remote, near) + LATENCY_STEPS["all_to_all"](group_size) * SCALE_OUT[self.scale_out].latency_s


def collective_time(op: str, size_bytes: float, group_size: int, link: Link) -> float:
    """Seconds for one collective of `size_bytes` (full size) over `group_size` ranks."""
    if group_size <= 1 or size_bytes <= 0:
        return 0.0
    return BUS_FACTOR[op](group_size) * size_bytes / link.bus_bw + LATENCY_STEPS[op](group_size) * link.latency_s


_shaped = by_identity(1)(Network._shaped)  # by the frozen network's identity and the plan's shape
