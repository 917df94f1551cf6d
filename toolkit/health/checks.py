"""Per-rank checks that need no peer: host and GPU facts, NUMA binding, a memory allocation, a matmul benchmark."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

# The environment that decides how NCCL/gloo pick transports and devices; differences between ranks are suspicious.
RELEVANT_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "UCX_", "FI_")
NUMA_ROOT = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' (the kernel's cpulist format) -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def numa_nodes_of(cpus: set[int], node_cpus: dict[int, set[int]]) -> list[int]:
    """The NUMA nodes whose CPUs this process may run on."""
    return sorted(node for node, members in node_cpus.items() if cpus & members)


def _node_cpus() -> dict[int, set[int]]:
    nodes = {}
    for path in NUMA_ROOT.glob("node[0-9]*"):
        with_list = path / "cpulist"
        if with_list.is_file():
            nodes[int(path.name[4:])] = parse_cpulist(with_list.read_text())
    return nodes


def match_gpu(device_name: str, catalogue: dict[str, str]) -> str | None:
    """The catalogue GPU a device name denotes ('NVIDIA H100 80GB HBM3' -> 'h100-80gb'); None when unsure.

    `catalogue` maps every name and alias to its canonical name.
    """
    words = set(re.split(r"[\s_\-]+", device_name.lower()))
    matches = {name: canonical for name, canonical in catalogue.items() if set(name.split("-")) <= words}
    if len(set(matches.values())) > 1:  # 'H100 80GB PCIe' fits h100-80gb and h100-pcie: the form factor decides
        same_form = {n: c for n, c in matches.items() if ("pcie" in n.split("-")) == ("pcie" in words)}
        matches = same_form or matches
    if len(set(matches.values())) > 1:  # the most specific name wins, if one is
        best = max(len(name.split("-")) for name in matches)
        matches = {n: c for n, c in matches.items() if len(n.split("-")) == best}
    canonical = set(matches.values())
    return canonical.pop() if len(canonical) == 1 else None


def host_facts(host: str, device) -> dict:
    """Hostname, pid, CPU binding and NUMA nodes, the relevant environment, and the GPU's identity when there is one."""
    affinity = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
    node_cpus = _node_cpus()
    facts = {
        "host": host,
        "pid": os.getpid(),
        "device": str(device),
        "cpu_affinity": _compact(affinity),
        "cpu_count": os.cpu_count(),
        "numa_nodes": numa_nodes_of(affinity, node_cpus) if node_cpus else None,
        "numa_node_count": len(node_cpus) or None,
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(RELEVANT_ENV_PREFIXES)},
    }
    if device.type == "cuda":
        facts.update(_gpu_facts(device))
    return facts


def _compact(cpus: set[int]) -> str:
    """{0, 1, 2, 5} -> '0-2,5': how taskset and numactl print a binding."""
    runs, ordered = [], sorted(cpus)
    for cpu in ordered:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def _gpu_facts(device) -> dict:
    import torch

    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", "") or "") or None
    facts = {"gpu_name": props.name, "gpu_uuid": uuid, "visible_devices": torch.cuda.device_count(),
             "memory_bytes": props.total_memory, "gpu_serial": _gpu_serial(uuid)}
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        domain = getattr(props, "pci_domain_id", 0)
        pci = f"{domain:04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
        numa = Path("/sys/bus/pci/devices", pci, "numa_node")
        facts["gpu_pci"] = pci
        facts["gpu_numa_node"] = int(numa.read_text()) if numa.is_file() else None
    return facts


def _gpu_serial(uuid: str | None) -> str | None:
    """The board serial (what a vendor RMA asks for); from NVML when installed, else nvidia-smi; None if neither."""
    if not uuid:
        return None
    gpu_id = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    try:
        import pynvml

        pynvml.nvmlInit()
        serial = pynvml.nvmlDeviceGetSerial(pynvml.nvmlDeviceGetHandleByUUID(gpu_id))
        return serial.decode() if isinstance(serial, bytes) else serial
    except Exception:  # NVML missing or refusing: fall back to the CLI
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=serial", "--format=csv,noheader", "-i", gpu_id],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def memory_check(device, fraction: float) -> str | None:
    """Allocate and touch `fraction` of the free GPU memory; the problem in one line, or None (also on CPU)."""
    import torch

    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    try:
        block = torch.empty(int(free * fraction) // 4, dtype=torch.float32, device=device)
        block.fill_(1.0)
        torch.cuda.synchronize(device)
        del block
    except RuntimeError as exc:  # CUDA OOM or an ECC/Xid error surfacing on first touch
        return f"allocating {fraction:.0%} of the {free / 2**30:.1f} GiB free failed: {str(exc).splitlines()[0][:160]}"
    finally:
        torch.cuda.empty_cache()
    return None


def cpu_threads_per_rank(local_world_size: int | None) -> int:
    """Intra-op threads for a CPU rank: its share of the cores it may use, so ranks do not fight for them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size or 1))
