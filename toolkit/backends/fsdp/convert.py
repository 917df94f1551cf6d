"""FSDP2 sharded checkpoint (Accelerate's SHARDED_STATE_DICT: torch DCP in pytorch_model_fsdp_0/) -> HF safetensors
(sharded, with index) + config, one tensor at a time.

The DCP metadata (`.metadata`, unpickled with safe_load.py's allow-list) lists each tensor's chunks (one per rank that
held a shard) and where each chunk's torch.save archive lies in the __R_0.distcp files. FSDP2 shards dim 0, so a
tensor's bytes are its chunks' bytes in order: where the dtype stays, the archives are indexed without loading them
(torch_zip.py) and the kernel copies each chunk's bytes into the safetensors file (copy_file_range), so nothing
passes through this process. Other layouts (chunks split along another dim, TP) and --dtype bf16 assemble each
tensor with DistCheckpointReader (toolkit/checkpoint/dcp.py, which reads Megatron's torch_dist checkpoints too): peak memory
is one tensor and one chunk, where `accelerate merge-weights` (DCP's _load_state_dict with no process group) loads
the whole model first. Names and values are those merge-weights writes (tests/fsdp/test_fsdp_convert.py compares
them bit for bit).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from toolkit.checkpoint.allow_lists import TENSORS
from toolkit.checkpoint.atomic import atomic_directory, check_output_dir
from toolkit.checkpoint.dcp import DistCheckpointReader, LiveBytes
from toolkit.checkpoint.hf_config import (
    check_tensors_match,
    copy_side_file,
    find_config,
    found_side_files,
    read_hf_config,
)
from toolkit.checkpoint.safe_load import read_dcp_metadata
from toolkit.checkpoint.safetensors_stream import ShardedSafetensorsWriter, parse_size
from toolkit.checkpoint.torch_zip import ITEMSIZE, index_torch_file
from toolkit.errors import UserInputError

log = logging.getLogger(__name__)
MODEL_DIR = "pytorch_model_fsdp_0"  # accelerate/utils/fsdp_utils.py save_fsdp_model: f"{FSDP_MODEL_NAME}_{index}"
KEY = "CKPT"


def model_dcp_dir(ckpt: Path) -> Path:
    """The DCP directory of the model weights: CKPT itself, or CKPT/pytorch_model_fsdp_0 of a Trainer checkpoint."""
    for candidate in (ckpt / MODEL_DIR, ckpt):
        if (candidate / ".metadata").is_file():
            return candidate
    if not ckpt.is_dir():
        raise UserInputError(KEY, f"{ckpt} does not exist")
    raise UserInputError(KEY, f"{ckpt} holds no FSDP sharded checkpoint ({MODEL_DIR}/.metadata, as Accelerate saves "
                              f"SHARDED_STATE_DICT)")


def hf_names(metadata) -> dict[str, str]:
    """Checkpoint key -> HF tensor name. Accelerate saves {"model": state_dict}; merge-weights unwraps a single top
    level the same way."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    paths = {key: tuple(metadata.planner_data.get(key, (key,))) for key, meta in metadata.state_dict_metadata.items()
             if isinstance(meta, TensorStorageMetadata)}
    tops = {path[0] for path in paths.values()}
    single = len(tops) == 1 and all(len(path) == 2 for path in paths.values())
    return {key: path[1] if single else ".".join(path) for key, path in paths.items()}


def convert_fsdp_to_hf(ckpt: Path, out_dir: Path, dtype: str = "fp32", max_shard_size: str = "5GB",
                       config: Path | None = None, progress: bool = False, live: LiveBytes | None = None) -> dict:
    import torch
    from tqdm import tqdm

    out_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(dtype)
    if out_dtype is None:
        raise UserInputError("--dtype", f"must be fp32 or bf16, got {dtype}")
    max_bytes = parse_size(max_shard_size)
    ckpt = Path(ckpt)
    check_output_dir(out_dir, inputs=[ckpt, config])
    source = model_dcp_dir(ckpt)
    config_path, own_config = find_config(ckpt, source, config)
    config_flag = "--config" if config is not None else str(config_path)
    config_data = read_hf_config(config_path, config_flag)
    metadata = read_dcp_metadata(source, KEY)
    names = hf_names(metadata)
    tensors = metadata.state_dict_metadata

    def target(key: str):
        stored = tensors[key].properties.dtype
        return out_dtype if stored.is_floating_point else stored

    layout = [(names[key], tuple(tensors[key].size), target(key)) for key in names]
    if not own_config:  # a --config (or the parent directory's) of another model would write an unloadable result
        check_tensors_match(config_data, config_path, {name: shape for name, shape, _ in layout}, config_flag)
    sides = found_side_files([source, ckpt], ckpt, KEY)
    reader = DistCheckpointReader(source, live, metadata=metadata, key=KEY)
    written = 0
    with atomic_directory(out_dir, inputs=[ckpt, config]) as tmp:
        writer = ShardedSafetensorsWriter(tmp, layout, max_bytes)
        with tqdm(total=writer.total, unit="B", unit_scale=True, desc="fsdp-to-hf",
                  disable=not progress or None) as bar:
            for key, (name, shape, dt) in zip(names, layout):
                ranges = row_ranges(source, tensors[key], metadata.storage_data, key) \
                    if dt == tensors[key].properties.dtype else None
                if ranges is not None:  # the stored bytes are the output bytes
                    nbytes = writer.copy_ranges(name, shape, dt, ranges)
                else:
                    tensor = reader.read(key, (0,) * len(shape), shape)
                    nbytes = writer.write(name, tensor.to(dt))
                    del tensor
                written += nbytes
                bar.update(nbytes)
        writer.close()
        shutil.copyfile(config_path, tmp / "config.json")
        for side, path in sides.items():
            copy_side_file(path, tmp / side, ckpt, KEY)
    ranks = len({info.relative_path for info in metadata.storage_data.values()})
    log.info("wrote %d tensors (%d bytes) in %d shard(s) to %s", len(layout), written, len(writer.shards), out_dir)
    return {"out_dir": str(out_dir), "tensors": len(layout), "bytes": written, "shards": len(writer.shards),
            "parameters": sum(int(torch.Size(shape).numel()) for _, shape, _ in layout), "rank_files": ranks,
            "config": config_data.get("model_type")}


def row_ranges(source: Path, meta, storage: dict, key: str) -> list[tuple[Path, int, int]] | None:
    """(file, byte offset, byte count) of each chunk's data in row order, when the chunks split the tensor along dim 0
    only (FSDP2's Shard(0)); None for any other layout."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    size = tuple(meta.size)
    chunks = sorted(meta.chunks, key=lambda c: tuple(c.offsets))
    row = 0
    ranges = []
    for chunk in chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if not size or offsets[0] != row or any(offsets[1:]) or sizes[1:] != size[1:]:
            return None
        row += sizes[0]
        info = storage.get(MetadataIndex(key, chunk.offsets))
        if info is None or info.transform_descriptors:
            return None
        lazy = index_torch_file(source / info.relative_path, (info.offset, info.length), TENSORS, KEY, source)
        stored = str(meta.properties.dtype).removeprefix("torch.")
        if getattr(lazy, "shape", None) != sizes or lazy.dtype != stored:
            return None
        ranges.append((lazy.path, lazy.offset, lazy.numel() * ITEMSIZE[stored]))
    return ranges if row == size[0] else None
