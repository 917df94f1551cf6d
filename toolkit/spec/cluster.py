"""The GPU catalogue (presets/gpus.yaml): memory, peak throughput and link bandwidths, with their sources; and the
`cpu` entry, the host itself, whose memory is this machine's RAM and whose peak is measured, not a datasheet's
(toolkit/estimate/device_peak.py measures it: the spec only declares)."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from toolkit.errors import UserInputError
from toolkit.numeric import FINITE

CATALOGUE = Path(__file__).resolve().parent.parent / "presets" / "gpus.yaml"
DEFAULT_GPU = "h100-80gb"
# the peak_tflops key a training precision runs at (fp32 training runs its matmuls in TF32 on tensor cores)
PEAK_KEY = {"fp8": "fp8", "fp4": "nvfp4", "fp32": "tf32"}
MAX_HOST_MEMORY_GB = 2**23  # 8 PiB of RAM per node: a byte count that stays an exact integer (2^53)


class GPU(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, **FINITE)

    name: str
    vendor: str
    memory_bytes: int = Field(gt=0, description="Device memory as torch.cuda reports total_memory; the host's RAM "
                                                "for the host entry.")
    peak_tflops: dict[str, float] = Field(description="Dense peak TFLOP/s per precision; for the host entry, the "
                                                      "whole host's (measured when absent: "
                                                      "toolkit/estimate/device_peak.py).")
    hbm_bandwidth_gbps: float
    compute_capability: str | None = Field(None, pattern=r"^\d+\.\d+$",
                                           description="NVIDIA parts' CUDA compute capability, major.minor: which "
                                                       "Transformer Engine recipes have kernels (spec/quantization.py).")
    intra_node_bw_gbps: float = Field(description="Unidirectional GB/s per GPU inside a node.")
    inter_node_bw_gbps: float = Field(description="Unidirectional GB/s per GPU across nodes.")
    pcie_bw_gbps: float = Field(description="Host <-> device GB/s, unidirectional.")
    gpus_per_node_default: int = 8
    nvlink_domain: int | None = Field(None, gt=0, description="GPUs on one NVLink/NVSwitch fabric where it spans "
                                                               "nodes (72 on an NVL72 rack); None: the node.")
    aliases: tuple[str, ...] = ()
    host_memory_bytes: int | None = Field(None, gt=0, description="RAM of one node for what offload keeps there, when "
                                                                   "the cluster states it (cluster.host_memory_gb, "
                                                                   "--host-memory-gb): plans needing more do not fit.")
    host: bool = Field(False, description="The machine running the toolkit (CPU ranks): its peak is a matmul "
                                          "measurement here, shared by the ranks on it, and its memory is its RAM.")


def topology_defaults(gpu: GPU, options: dict) -> dict:
    """`options` with the cluster's shape the GPU's catalogue entry implies where they leave it unset: its node size
    (4 on GB200/GB300 trays; the host entry keeps the plan option's default) and its NVLink domain (72 on an NVL72
    rack, counted in this plan's processes per node; else the node)."""
    filled = dict(options)
    if filled.get("gpus_per_node") is None and not gpu.host:
        filled["gpus_per_node"] = gpu.gpus_per_node_default
    if filled.get("nvlink_domain") is None and gpu.nvlink_domain and gpu.nvlink_domain > gpu.gpus_per_node_default:
        per_node = filled.get("gpus_per_node") or gpu.gpus_per_node_default
        filled["nvlink_domain"] = min(gpu.nvlink_domain, gpu.nvlink_domain // gpu.gpus_per_node_default * per_node)
    return filled


def with_host_memory(gpu: GPU, host_memory_gb: float | None) -> GPU:
    """The GPU with its node's stated RAM (None: unstated, not checked)."""
    if host_memory_gb is None:
        return gpu
    if not 0 < host_memory_gb <= MAX_HOST_MEMORY_GB:
        raise UserInputError("--host-memory-gb", f"must be a number of GiB above 0 and at most {MAX_HOST_MEMORY_GB:,}, "
                                                 f"got {host_memory_gb!r}")
    return gpu.model_copy(update={"host_memory_bytes": int(host_memory_gb * 2**30)})


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@lru_cache(maxsize=1)
def load_catalogue() -> dict[str, GPU]:
    import yaml

    raw = yaml.safe_load(CATALOGUE.read_text())["gpus"]
    gpus: dict[str, GPU] = {}
    for name, fields in raw.items():
        if fields.get("host"):
            fields = {**fields, "memory_bytes": host_memory_bytes()}
        gpu = GPU(name=name, **fields)
        gpus[name] = gpu
        for alias in gpu.aliases:
            gpus[alias] = gpu
    return gpus


def get_gpu(name: str) -> GPU:
    catalogue = load_catalogue()
    gpu = catalogue.get(name.lower())
    if gpu is None:
        raise UserInputError("--gpu", f"unknown GPU '{name}'; known: {', '.join(sorted(catalogue))}")
    return gpu


def peak_key(precision: str) -> str:
    """The peak_tflops key a training precision runs at (bf16 for the 16-bit ones); a low-precision recipe's GEMMs
    run at its own (spec/quantization.py gemm_peak_key)."""
    return PEAK_KEY.get(precision, "bf16")


def capability(gpu: GPU) -> tuple[int, int] | None:
    """The part's CUDA compute capability as (major, minor), as torch.cuda.get_device_capability returns it; None
    where the catalogue states none (AMD parts, the host)."""
    if gpu.compute_capability is None:
        return None
    major, minor = gpu.compute_capability.split(".")
    return int(major), int(minor)
