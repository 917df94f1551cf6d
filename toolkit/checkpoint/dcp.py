"""torch.distributed.checkpoint (DCP) directories read one tensor chunk at a time, checked and described: the format
under Megatron-Core's torch_dist checkpoints and Accelerate's FSDP2 SHARDED_STATE_DICT, and a bare DCP directory.

Each chunk's file, offset and length come from the DCP metadata (`.metadata`, unpickled with safe_load.py's
allow-list); a chunk is one torch.save archive, loaded straight from its bytes. Megatron-Core's writer of such
checkpoints is toolkit/backends/megatron/dist_writer.py.
"""

from __future__ import annotations

import logging
import os
import pickle
import weakref
from collections.abc import Callable
from pathlib import Path

from toolkit.checkpoint.safe_load import read_dcp_metadata, torch_load
from toolkit.checkpoint.torch_zip import FileSlice
from toolkit.errors import UserInputError
from toolkit.readers import open_regular

log = logging.getLogger(__name__)


class LiveBytes:
    """Bytes of the tensor storages a conversion has materialised and not yet freed; `peak` is the most at any one
    time (the memory bound the tests assert). A storage is registered where a tensor changes hands (each tensor
    read, each whole model tensor, each tensor handed to a writer) and counted until the storage itself is freed,
    whoever still holds a view of it (a writer's own dict included). Temporaries inside one transform (a
    concatenation's inputs) are not registered: they live within a single tensor's step."""

    def __init__(self):
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}  # id of a live registered storage -> bytes

    def track(self, tensor):
        storage = tensor.untyped_storage()  # torch keeps one Python object per storage while it lives
        if id(storage) not in self._sizes:
            self._sizes[id(storage)] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._release, id(storage))
        return tensor

    def _release(self, key: int) -> None:
        self.live -= self._sizes.pop(key)


def tracker(live: LiveBytes | None) -> Callable:
    """What registers a tensor with `live` (nothing, without one)."""
    return live.track if live else _untracked


def _untracked(tensor):
    return tensor



class DistCheckpointReader:
    """Regions of the tensors of a torch DCP checkpoint (Megatron-Core's torch_dist, Accelerate's FSDP2
    SHARDED_STATE_DICT), read chunk by chunk from the files the metadata names."""

    def __init__(self, ckpt: Path, live: LiveBytes | None = None, metadata=None, key: str = "MEGATRON_DIR"):
        """`key` names the input in errors (the flag, or the checkpoint for `dmt ckpt verify`)."""
        metadata = read_dcp_metadata(ckpt, key) if metadata is None else metadata
        self.ckpt, self.tensors, self.storage = ckpt, metadata.state_dict_metadata, metadata.storage_data
        self.track = tracker(live)
        self.key = key

    def read(self, key: str, offsets, sizes, global_shape=None):
        """The region [offsets, offsets + sizes) of checkpoint tensor `key`, assembled from the chunks it overlaps."""
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

        meta = self.tensors.get(key)
        if not isinstance(meta, TensorStorageMetadata):
            raise UserInputError(self.key, f"{self.ckpt} holds no tensor {key}: not this model's checkpoint")
        if global_shape is not None and tuple(meta.size) != tuple(global_shape):
            raise UserInputError(self.key, f"{self.ckpt}: {key} is {tuple(meta.size)}, this model's config.json "
                                           f"implies {tuple(global_shape)}")
        for chunk in meta.chunks:  # the usual case: the region is one chunk, returned as loaded
            if tuple(chunk.offsets) == tuple(offsets) and tuple(chunk.sizes) == tuple(sizes):
                return self.load_chunk(MetadataIndex(key, chunk.offsets), chunk.sizes)
        out = self.track(torch.empty(sizes, dtype=meta.properties.dtype))
        covered = 0
        for chunk in meta.chunks:
            lo = [max(o, c) for o, c in zip(offsets, chunk.offsets)]
            hi = [min(o + s, c + n) for o, s, c, n in zip(offsets, sizes, chunk.offsets, chunk.sizes)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            data = self.load_chunk(MetadataIndex(key, chunk.offsets), chunk.sizes)
            source = data[tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, chunk.offsets))]
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))] = source
            covered += source.numel()
            del data, source
        if covered != out.numel():
            raise UserInputError(self.key, f"{self.ckpt}: the chunks of {key} do not cover "
                                           f"{tuple(offsets)} + {tuple(sizes)}")
        return out

    def _storage(self, index):
        info = self.storage.get(index)
        if info is None:
            raise UserInputError(self.key, f"{self.ckpt}: no storage entry for {index.fqn} at "
                                           f"{tuple(index.offset)}")
        return info

    def _open(self, path: Path, info):
        """The storage file of a chunk or object, through the one opener: a regular file inside the checkpoint that
        holds the bytes the metadata records for it (they alone are read)."""
        return open_regular(path, self.key, "a storage file of this checkpoint", self.ckpt, info.offset + info.length)

    def object_bytes(self, index) -> tuple[Path, bytes]:
        """The file and the stored bytes of one object (a ShardedObject's torch.save archive)."""
        info = self._storage(index)
        path = self.ckpt / info.relative_path
        try:
            with self._open(path, info) as handle:
                data = os.pread(handle.fileno(), info.length, info.offset)
        except OSError as exc:
            raise UserInputError(self.key, f"cannot read {path} ({exc.strerror})") from None
        if len(data) != info.length:
            raise UserInputError(self.key, f"{path}: ends before object {index.fqn} does (truncated)")
        return path, data

    def load_chunk(self, index, sizes):
        """One stored chunk of a tensor, as saved (its file, offset and length from the metadata)."""
        info = self._storage(index)
        if info.transform_descriptors:
            raise UserInputError(self.key, f"{self.ckpt}: {index.fqn} is stored with transforms "
                                           f"{info.transform_descriptors}, which this reader does not undo")
        path = self.ckpt / info.relative_path
        try:
            with self._open(path, info) as handle:
                tensor = torch_load(FileSlice(handle, info.offset, info.length), path, self.key)
        except UserInputError:  # a global outside the allow-list, named (a ValueError too)
            raise
        except (OSError, EOFError, RuntimeError, ValueError, pickle.UnpicklingError) as exc:
            raise UserInputError(self.key, f"{path}: cannot read {index.fqn} ({exc}): truncated or corrupt") from None
        if tuple(tensor.shape) != tuple(sizes):
            raise UserInputError(self.key, f"{path}: {index.fqn} holds {tuple(tensor.shape)}, the metadata "
                                           f"says {tuple(sizes)}")
        return self.track(tensor)
