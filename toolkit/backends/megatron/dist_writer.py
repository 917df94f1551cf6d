"""Megatron-Core torch_dist checkpoints written one tensor chunk at a time, never a whole state dict.

The map comes from Megatron-Core itself: a GPTModel built on the meta device (no weight memory) gives its
`sharded_state_dict()`, i.e. each weight's checkpoint key, global shape, offset in the layer-stacked tensor and
factories (gated fc1 saved as its gate and up halves). Writing runs torch DCP's `save` with a plan of those chunks
whose data a planner makes only when the writer asks for it, and a writer that drops each chunk once written.
Reading is DCP's, chunk by chunk (toolkit/checkpoint/dcp.py). Megatron-Core's `dist_checkpointing` loads what is
written here at any TP/PP (tests/megatron/test_megatron_convert.py).
"""

from __future__ import annotations

import io
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path

from toolkit.checkpoint.dcp import LiveBytes, tracker
from toolkit.compat.torch_seams import storage_entry

# the manifest's `format` of a Megatron-Core dist_checkpointing (torch_dist) checkpoint, as training saves it and this
# writer writes it (the checkpoint part's MANIFEST_FORMAT)
MANIFEST_FORMAT = "megatron-core-dist"

log = logging.getLogger(__name__)


def chunk_shape(sharded_tensor) -> tuple[int, ...]:
    return (1,) * sharded_tensor.prepend_axis_num + tuple(sharded_tensor.local_shape)


def _factory_parts(factory, data) -> list:
    """The ShardedTensors a factory builds from `data` (meta or real), in its build order."""
    import dataclasses

    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return list(nested_values(dataclasses.replace(factory, data=data).build()))




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

    track = tracker(live)
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
                                         torch.Size(chunk_shape(sharded_tensor)))
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
        chunk = tensor.reshape(chunk_shape(entry)).contiguous()
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
