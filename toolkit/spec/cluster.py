"""The GPU catalogue (presets/gpus.yaml): memory, peak throughput and link bandwidths, with their sources."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from toolkit.errors import UserInputError

CATALOGUE = Path(__file__).resolve().parent.parent / "presets" / "gpus.yaml"
DEFAULT_GPU = "h100-80gb"


class GPU(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    vendor: str
    memory_bytes: int = Field(gt=0, description="Device memory as torch.cuda reports total_memory.")
    peak_tflops: dict[str, float] = Field(description="Dense peak TFLOP/s per precision.")
    hbm_bandwidth_gbps: float
    intra_node_bw_gbps: float = Field(description="Unidirectional GB/s per GPU inside a node.")
    inter_node_bw_gbps: float = Field(description="Unidirectional GB/s per GPU across nodes.")
    pcie_bw_gbps: float = Field(description="Host <-> device GB/s, unidirectional.")
    gpus_per_node_default: int = 8
    aliases: tuple[str, ...] = ()


@lru_cache(maxsize=1)
def load_catalogue() -> dict[str, GPU]:
    import yaml

    raw = yaml.safe_load(CATALOGUE.read_text())["gpus"]
    gpus: dict[str, GPU] = {}
    for name, fields in raw.items():
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
