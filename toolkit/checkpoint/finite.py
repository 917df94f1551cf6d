"""`dmt ckpt verify --deep`: NaN/Inf scans of every floating tensor a checkpoint holds (weights, fp32 masters and
optimizer moments), read a bounded piece at a time so that memory follows the piece, not the checkpoint.

An optimizer whose exp_avg_sq went NaN resumes into NaN weights at the next step although the weights are finite
today, so the optimizer state is scanned as well as the weights: in a dist checkpoint every tensor chunk and every
tensor inside a stored object; in a torch.save file indexed lazily (DeepSpeed ZeRO's rank files, scanned by
toolkit/backends/deepspeed/checkpoint.py) every floating tensor, a piece at a time.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

from toolkit.checkpoint.dcp import DistCheckpointReader
from toolkit.checkpoint.safe_load import torch_load
from toolkit.checkpoint.torch_zip import LazyTensor
from toolkit.errors import UserInputError

PIECE = 1 << 22  # elements read at a time from a DeepSpeed rank file (16 MiB of fp32)
Finding = tuple[Path, "str | None"]  # one per tensor scanned: its file, and the problem (None: finite)


def nonfinite(tensor) -> int:
    """NaN and Inf values in a tensor (0 for integer tensors)."""
    import torch

    if not tensor.is_floating_point():
        return 0
    return int(tensor.numel() - torch.isfinite(tensor).sum())


def lazy_tensors(value, key: str) -> Iterator[tuple[str, object]]:
    """(dotted key, LazyTensor) for every tensor in an indexed torch.save object."""
    if isinstance(value, LazyTensor):
        yield key, value
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from lazy_tensors(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from lazy_tensors(item, f"{key}.{index}")


def lazy_nonfinite(lazy) -> int:
    bad = 0
    for start in range(0, lazy.numel(), PIECE):
        bad += nonfinite(lazy.read(start, min(PIECE, lazy.numel() - start)))
    return bad


def finding(file: Path, what: str, bad: int) -> Finding:
    return file, f"{what} holds {bad} NaN/Inf values" if bad else None


def dcp_findings(path: Path, metadata) -> Iterator[Finding]:
    """A torch.distributed.checkpoint directory (Megatron-Core's torch_dist): every stored chunk of every floating
    tensor, model and optimizer alike, one chunk in memory at a time, and the tensors inside stored objects."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    reader = DistCheckpointReader(path, metadata=metadata, key=str(path))
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata) and meta.properties.dtype.is_floating_point:
            bad = sum(nonfinite(reader.load_chunk(MetadataIndex(key, c.offsets), c.sizes)) for c in meta.chunks)
            yield finding(path, f"tensor {key}", bad)
        elif isinstance(meta, BytesStorageMetadata):
            for index in (i for i in metadata.storage_data if i.fqn == key):
                yield from _object_findings(reader, index)


def _object_findings(reader, index) -> Iterator[Finding]:
    """Tensors inside one stored object (Megatron's ShardedObjects: RNG states, optimizer pieces saved whole)."""
    import pickle

    import torch

    file, data = reader.object_bytes(index)
    try:
        value = torch_load(io.BytesIO(data), file, str(file))
    except UserInputError as exc:  # a global outside the allow-list: named, nothing run
        yield file, f"object {index.fqn}: {exc.message}"
        return
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        yield file, f"object {index.fqn} cannot be read ({type(exc).__name__}): truncated or corrupt"
        return
    stack = [(index.fqn, value)]
    while stack:
        key, item = stack.pop()
        if isinstance(item, torch.Tensor) and item.is_floating_point():
            yield finding(file, f"tensor {key}", nonfinite(item))
        elif isinstance(item, dict):
            stack += [(f"{key}.{k}", v) for k, v in item.items()]
        elif isinstance(item, (list, tuple)):
            stack += [(f"{key}.{i}", v) for i, v in enumerate(item)]


def safetensors_findings(file: Path) -> Iterator[Finding]:
    """Every tensor of one safetensors file (whose header has been read and checked)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield finding(file, f"tensor {name}", nonfinite(handle.get_tensor(name)))
    except Exception as exc:  # safetensors raises its own error types for damaged data
        raise UserInputError(str(file), f"cannot be read as safetensors ({type(exc).__name__}: {exc})") from None
