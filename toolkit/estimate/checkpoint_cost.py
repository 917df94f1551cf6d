"""What one checkpoint costs a plan: its bytes, the time to write them and the time training is blocked by it.

- Bytes per save: every trained parameter as the engine keeps it, with its optimizer states (the backend's
  `saved_bytes_per_param`: 14 B/param for bf16 AdamW under DeepSpeed and Megatron-Core, 12 under FSDP2, whose fp32
  shards are their own master copy). The frozen base of a LoRA run is not saved, only its adapters.
- Write time: the ranks write their shards in parallel (DCP, Megatron-Core's fully parallel save and ZeRO's
  partitions spread the bytes over the data-parallel ranks), so the nodes share the bytes evenly, each at the
  storage's bandwidth per node. Reading a checkpoint back after a failure is taken at the same rate.
- Blocking: a synchronous save stops training for the whole write. An asynchronous one (DCP async_save,
  Megatron-Core's persistent async worker, DeepSpeed's decoupled engine) stops it only while each rank copies its
  own model and optimizer states from the GPU to host memory; the busiest rank's copy decides. Its states on the GPU
  are the memory estimate's weights and optimizer bytes (nothing to copy for what ZeRO-Offload keeps on the host)
  and the copy runs at the GPU's host link (the catalogue's pcie_bw_gbps, the link's peak: a lower bound of the
  stall, as pinned copies reach 80-90% of it and pageable ones less).
- Reload: from shared storage at the write rate; from node-local checkpoints (checkpoint.local, NVRx's local
  checkpoint manager) each rank reads its own states back from its node's memory or disk, at the same host link as
  the asynchronous copy (a lower bound; a node that was lost reads its replica from a peer over the network).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toolkit.estimate.goodput import LLAMA3_GPUS
from toolkit.spec.backends import backend_of
from toolkit.spec.plan import Plan

GB = 1e9

# Llama 3's storage (arXiv:2407.21783, Sec. 3.3.1): Tectonic "supports a sustainable throughput of 2 TB/s", which
# the 405B run's checkpoints shared over its 16,384 GPUs, 2,048 nodes of 8: 0.98 GB/s per node. A cluster's own
# file system differs by an order of magnitude either way: pass --checkpoint-write-bw (or --checkpoint-write-s).
LLAMA3_STORAGE_SUSTAINED_GBPS = 2000
LLAMA3_GPUS_PER_NODE = 8
WRITE_BW_GBPS_PER_NODE = LLAMA3_STORAGE_SUSTAINED_GBPS / (LLAMA3_GPUS / LLAMA3_GPUS_PER_NODE)


@dataclass(frozen=True)
class CheckpointCost:
    bytes: int  # one save, all ranks together
    local_bytes: int  # the busiest rank's states on its GPU: what an asynchronous save copies to the host first
    write_s: float  # until the save is complete on storage
    blocking_s: float  # training paused by it
    reload_s: float  # reading it back after a failure
    async_save: bool


def checkpoint_bytes(trained_params: int, plan: Plan) -> int:
    """Bytes of one save: the trained parameters with their optimizer states, as the backend saves them."""
    return trained_params * backend_of(plan).memory.saved_bytes_per_param(plan)


def checkpoint_cost(trained_params: int, plan: Plan, local_bytes: int, host_link_gbps: float, async_save: bool,
                    write_bw_gbps_per_node: float = WRITE_BW_GBPS_PER_NODE,
                    write_s: float | None = None, local_reload: bool = False) -> CheckpointCost:
    """The cost of one save of `plan`; `write_s` a measured write time that replaces the computed one;
    `local_reload`: a restart reads node-local checkpoints (checkpoint.local) instead of shared storage."""
    total = checkpoint_bytes(trained_params, plan)
    nodes = math.ceil(plan.gpus / plan.gpus_per_node)
    computed = total / (nodes * write_bw_gbps_per_node * GB)
    written = computed if write_s is None else write_s
    copied = local_bytes / (host_link_gbps * GB)
    return CheckpointCost(bytes=total, local_bytes=local_bytes, write_s=written,
                          blocking_s=min(copied, written) if async_save else written,
                          reload_s=min(copied, written) if local_reload else written,
                          async_save=async_save)
