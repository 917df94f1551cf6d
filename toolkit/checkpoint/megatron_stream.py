"""Megatron-Core torch_dist checkpoints written and read one tensor chunk at a time, never a whole state dict.

The map comes from Megatron-Core itself: a GPTModel built on the meta device (no weight memory) gives its
`sharded_state_dict()`, i.e. each weight's checkpoint key, global shape, offset in the layer-stacked tensor and
factories (gated fc1 saved as its gate and up halves). Writing runs torch DCP's `save` with a plan of those chunks
whose data a planner makes only when the writer asks for it, and a writer that drops each chunk once written;
reading takes each chunk's file, offset and length from the DCP metadata. Megatron-Core's `dist_checkpointing`
loads what is written here at any TP/PP (tests/megatron/test_megatron_convert.py).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

from toolkit.checkpoint.safe_load import read_dcp_metadata, torch_load
from toolkit.errors import UserInputError

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


def _untracked(tensor):
    return tensor


def _chunk_shape(sharded_tensor) -> tuple[int, ...]:
    return (1,) * sharded_tensor.prepend_axis_num + tuple(sharded_tensor.local_shape)


def _factory_parts(factory, data) -> list:
    """The ShardedTensors a factory builds from `data` (meta or real), in its build order."""
    import dataclasses

    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return list(nested_values(dataclasses.replace(factory, data=data).build()))


# -- writing ------------------------------------------------------------------------------------------------------

def write_dist_checkpoint(out_dir: Path, sharded: dict, model_tensor: Callable[[str], object],
                          on_chunk: Callable[[int], None] = lambda n: None, live: LiveBytes | None = None) -> None:
    """Write a torch_dist checkpoint of the meta `sharded` state dict into `out_dir`, asking `model_tensor(name)` for
    each model tensor when the writer reaches it (and dropping it after its last chunk); `on_chunk(bytes)` after each
    chunk."""
    import torch
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.state_dict_saver import save

    track = live.track if live else _untracked
    items, sources = [], {}  # sources: write-item index -> (model name, factory part or None, ShardedTensor)
    for name, entry in sharded.items():
        if isinstance(entry, ShardedObject):
            if is_main_replica(entry.replica_id):  # Megatron saves a list of the objects of one unique key
                index = MetadataIndex(entry.unique_key)
                items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
                sources[index] = (name, None, entry)
            continue
        parts = [(None, entry)] if isinstance(entry, ShardedTensor) else enumerate(_factory_parts(entry, entry.data))
        for part, sharded_tensor in parts:
            if not is_main_replica(sharded_tensor.replica_id):
                continue
            index = MetadataIndex(sharded_tensor.key, sharded_tensor.global_offset)
            chunk = ChunkStorageMetadata(torch.Size(sharded_tensor.global_offset),
                                         torch.Size(_chunk_shape(sharded_tensor)))
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=chunk, properties=TensorProperties(dtype=sharded_tensor.dtype),
                size=torch.Size(sharded_tensor.global_shape))))
            sources[index] = (name, part, sharded_tensor)

    last: dict = {}  # the model tensor of the chunk being written: its factory halves follow one another

    def resolve(item):
        name, part, entry = sources[item.index]
        if item.type == WriteItemType.BYTE_IO:
            data = io.BytesIO()
            torch.save([entry.data], data)
            return data
        if last.get("name") != name:
            last.clear()
            last.update(name=name, tensor=track(model_tensor(name)))
        tensor = last["tensor"]
        if part is not None:
            tensor = _factory_parts(sharded[name], tensor)[part].data
        chunk = tensor.reshape(_chunk_shape(entry)).contiguous()
        if chunk.untyped_storage().nbytes() != chunk.numel() * chunk.element_size():
            # a view (a SwiGLU fc1 half, a slice): torch.save would write the whole storage behind it, e.g. the fused
            # fc1 once more for each half; DCP's own writer copies such views first, as here
            chunk = chunk.clone()
        chunk = track(chunk)
        on_chunk(chunk.numel() * chunk.element_size())
        return chunk

    writer = one_item_at_a_time_writer(out_dir)
    with warnings.catch_warnings():  # one process writes everything: DCP's "assuming a single process" is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save({}, storage_writer=writer, planner=lazy_save_planner(items, resolve), no_dist=True)
    last.clear()
    torch.save({}, out_dir / "common.pt")  # what Megatron's saver writes for a model-only state dict
    save_config(CheckpointingConfig("torch_dist", 1), str(out_dir))
    log.debug("wrote %d chunks and objects into %s", len(items), out_dir)


def one_item_at_a_time_writer(out_dir: Path):
    """DCP's FileSystemWriter (plan prefixes, `.metadata`, storage entries) with its own `write_data`: the torch one
    keeps every written tensor in a dict until its file is closed (one chunk per key: the embedding, the output layer
    and a whole layer), this one drops each chunk once it is in the file. Same file format: each tensor a torch.save
    archive, each object its bytes, at the offsets the storage entries record."""
    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

    from toolkit.compat.torch_seams import storage_entry
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class OneItemAtATimeWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            file_name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            results = []
            with open(Path(self.path) / file_name, "wb") as stream:
                for item in sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO):  # objects first
                    offset = stream.tell()
                    data = planner.resolve_data(item)
                    if item.type == WriteItemType.BYTE_IO:
                        stream.write(data.getbuffer())
                    else:
                        torch.save(data, stream)
                    del data
                    length = stream.tell() - offset
                    results.append(WriteResult(index=item.index, size_in_bytes=length,
                                               storage_data=storage_entry(file_name, offset, length)))
                stream.flush()
                os.fsync(stream.fileno())
            done: Future = Future()
            done.set_result(results)
            return done

    return OneItemAtATimeWriter(str(out_dir), single_file_per_rank=True, thread_count=1)


def lazy_save_planner(items: list, resolve: Callable):
    """A DCP save planner with a fixed plan of `items` whose data `resolve(item)` makes when the writer asks."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan

    class LazySavePlanner(DefaultSavePlanner):
        """A fixed plan of write items whose data `resolve` makes on demand (no state dict behind it)."""

        def __init__(self, items, resolve):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.items, self.resolve = items, resolve

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
            self.state_dict, self.is_coordinator = {}, is_coordinator

        def create_local_plan(self):
            self.plan = SavePlan(self.items)
            return self.plan

        def resolve_data(self, write_item):
            return self.resolve(write_item)

    return LazySavePlanner(items, resolve)


# -- reading ------------------------------------------------------------------------------------------------------

class DistCheckpointReader:
    """Regions of the tensors of a torch DCP checkpoint (Megatron-Core's torch_dist, Accelerate's FSDP2
    SHARDED_STATE_DICT), read chunk by chunk from the files the metadata names."""

    def __init__(self, ckpt: Path, live: LiveBytes | None = None, metadata=None, key: str = "MEGATRON_DIR"):
        """`key` names the input in errors (the flag, or the checkpoint for `dmt ckpt verify`)."""
        metadata = read_dcp_metadata(ckpt, key) if metadata is None else metadata
        self.ckpt, self.tensors, self.storage = ckpt, metadata.state_dict_metadata, metadata.storage_data
        self.track = live.track if live else _untracked
        self.key = key

    def model_tensor(self, entry):
        """The whole local tensor a meta ShardedTensor or ShardedTensorFactory of a TP=1 model stands for."""
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        if isinstance(entry, ShardedTensor):
            return self.read(entry.key, entry.global_offset, _chunk_shape(entry), entry.global_shape).reshape(
                entry.local_shape)
        loaded = dict_list_map_inplace(self.model_tensor, entry.build())  # the parts, read; then merged
        return self.track(entry.merge_fn(loaded))

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

    def object_bytes(self, index) -> tuple[Path, bytes]:
        """The file and the stored bytes of one object (a ShardedObject's torch.save archive)."""
        info = self._storage(index)
        path = self.ckpt / info.relative_path
        try:
            with open(path, "rb") as handle:
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
            with open(path, "rb") as handle:
                if os.fstat(handle.fileno()).st_size < info.offset + info.length:
                    raise EOFError(f"the file ends before byte {info.offset + info.length}")
                tensor = torch_load(FileSlice(handle, info.offset, info.length), path, self.key)
        except UserInputError:  # a global outside the allow-list, named (a ValueError too)
            raise
        except (OSError, EOFError, RuntimeError, ValueError, pickle.UnpicklingError) as exc:
            raise UserInputError(self.key, f"{path}: cannot read {index.fqn} ({exc}): truncated or corrupt") from None
        if tuple(tensor.shape) != tuple(sizes):
            raise UserInputError(self.key, f"{path}: {index.fqn} holds {tuple(tensor.shape)}, the metadata "
                                           f"says {tuple(sizes)}")
        return self.track(tensor)


class FileSlice(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file as a file of their own: torch.load reads one chunk's
    torch.save archive from it straight into the tensor's storage (no copy of the chunk's bytes first)."""

    def __init__(self, handle, offset: int, length: int):
        super().__init__()
        self.handle, self.start, self.length, self.position = handle, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        self.position = position + {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        return self.position

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")[: max(0, self.length - self.position)]
        self.handle.seek(self.start + self.position)
        count = self.handle.readinto(view) or 0
        self.position += count
        return count
