"""How much /dev/shm a training pod needs: NCCL's proxy segments for every communicator a rank opens, and the data
loader's worker batches. Kubernetes gives a pod 64 MB unless a memory-backed emptyDir is mounted there.

Source: Kubeflow Trainer, docs/user-guides/megatron.md ("Increasing /dev/shm for NCCL", commit 58cad8db39):
"NCCL allocates shared memory in /dev/shm for its proxy service (roughly 33 MB per communicator)"."""

from __future__ import annotations

import math
import re

from toolkit.spec.plan import Plan
from toolkit.spec.recipe_data import IN_MEMORY_WORKERS

NCCL_SHM_PER_COMMUNICATOR = 33 * 10**6  # bytes, the Trainer docs' "roughly 33 MB"
PREFETCH_FACTOR = 2  # torch DataLoader's batches in flight per worker (its default)
TOKEN_TENSORS = 2  # input ids and labels, int64, per sequence
MIB = 2**20


def communicators(plan: Plan) -> dict[str, int]:
    """The process groups a rank of this plan communicates in (name -> size): the whole world, and every parallel
    dimension of more than one rank (each an NCCL communicator of its own)."""
    groups = {"world": plan.gpus, "dp": plan.dp, "tp": plan.tp, "pp": plan.pp, "cp": plan.cp, "ep": plan.ep}
    return {name: size for name, size in groups.items() if size > 1 or name == "world"}


def shm_bytes(plan: Plan, ranks_per_node: int, loader_workers: int | None = None) -> int:
    """The /dev/shm a node of ranks_per_node ranks needs, rounded up to whole MiB; `loader_workers`: the recipe's data
    loader workers per rank (toolkit.spec.recipe.data_workers), the in-memory sources' default when not known."""
    nccl = len(communicators(plan)) * NCCL_SHM_PER_COMMUNICATOR
    batch = plan.micro_batch * plan.seq_len * TOKEN_TENSORS * 8
    workers = (IN_MEMORY_WORKERS if loader_workers is None else loader_workers) * PREFETCH_FACTOR * batch
    return math.ceil(ranks_per_node * (nccl + workers) / MIB) * MIB


def quantity(nbytes: int) -> str:
    """Bytes as a Kubernetes quantity: whole GiB or MiB."""
    return f"{nbytes // 2**30}Gi" if nbytes % 2**30 == 0 else f"{math.ceil(nbytes / MIB)}Mi"


_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:([eE][-+]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?)$")
# the largest quantity the API server stores (an int64 of its base unit), and the exponents that can reach it
QUANTITY_MAX, QUANTITY_EXPONENT_MAX = 2**63 - 1, 30
_SCALE = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity_bytes(text) -> float | None:
    """A Kubernetes quantity (`512Mi`, `1G`, `1e9`, `2`) as a number; None if it is not one."""
    match = _QUANTITY.fullmatch(str(text).strip())
    if not match:
        return None
    number, exponent, suffix = match.groups()
    if exponent and abs(int(exponent[1:])) > QUANTITY_EXPONENT_MAX:  # 1e999999: no float, and 10**n takes for ever
        return None
    value = float(number) * (10.0 ** int(exponent[1:]) if exponent else _SCALE[suffix or ""])
    return value if value <= QUANTITY_MAX else None
