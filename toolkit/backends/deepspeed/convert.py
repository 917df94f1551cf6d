"""DeepSpeed ZeRO checkpoint -> HF safetensors (sharded, with index) + config, streamed one tensor at a time."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from toolkit.backends.deepspeed.zero_checkpoint import open_zero_checkpoint, rank_files, resolve_tag_dir
from toolkit.checkpoint.atomic import atomic_directory, check_output_dir
from toolkit.checkpoint.hf_config import (
    check_tensors_match,
    copy_side_file,
    find_config,
    found_side_files,
    read_hf_config,
)
from toolkit.checkpoint.manifest import MANIFEST, manifest_problems, read_manifest
from toolkit.checkpoint.safetensors_stream import ShardedSafetensorsWriter, parse_size
from toolkit.errors import UserInputError

log = logging.getLogger(__name__)

# Larger files are checked against the manifest by size only: hashing them would read several times the bytes the
# conversion copies (each rank file holds Adam's two moments beside the fp32 weights); `dmt ckpt verify` hashes all.
HASH_UP_TO = 256 * 2**20


@dataclass(frozen=True)
class ConversionResult:
    out_dir: Path
    tensors: int
    bytes_written: int
    shards: int
    stage: int
    world_size: int


def check_against_manifest(ckpt_dir: Path, tag_dir: Path, reads: list[Path]) -> None:
    """The files the conversion `reads`, against the checkpoint's manifest when it has one: a missing file, another
    size, or another sha256 (files up to HASH_UP_TO) is a UserInputError naming the file. Copying a damaged
    checkpoint would give weights that load and are wrong."""
    root = next((d for d in (ckpt_dir, tag_dir.parent) if (d / MANIFEST).is_file()), None)
    if root is None:
        return
    problems = manifest_problems(root, read_manifest(root), only=set(reads), hash_up_to=HASH_UP_TO)
    if problems:
        file, problem = problems[0]
        raise UserInputError(str(file), f"{problem}; the checkpoint is damaged (`dmt ckpt verify {root}` lists "
                                        f"every problem); nothing was written")
    log.info("%d input files agree with %s (sha256 of those up to %d bytes, sizes of the rest)", len(reads),
             root / MANIFEST, HASH_UP_TO)


def convert_zero_to_hf(
    ckpt_dir: Path,
    out_dir: Path,
    tag: str | None = None,
    dtype: str = "fp32",
    max_shard_size: str = "5GB",
    config: Path | None = None,
    progress: bool = True,
) -> ConversionResult:
    from tqdm import tqdm

    # dtype names: the fp32 path copies bytes and never imports torch (its import alone is ~1.5 s)
    out_dtype = {"fp32": "float32", "bf16": "bfloat16"}.get(dtype)
    if out_dtype is None:
        raise UserInputError("--dtype", f"must be fp32 or bf16, got {dtype}")
    max_bytes = parse_size(max_shard_size)
    check_output_dir(out_dir, inputs=[ckpt_dir, config])
    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    config_path, own_config = find_config(ckpt_dir, tag_dir, config)
    sides = found_side_files([tag_dir, ckpt_dir], ckpt_dir, "CKPT_DIR")  # the tag directory's copy, when both have one
    check_against_manifest(ckpt_dir, tag_dir, [*rank_files(tag_dir), config_path, *sides.values()])
    checkpoint = open_zero_checkpoint(ckpt_dir, tag)
    config_flag = "--config" if config is not None else str(config_path)
    config_data = read_hf_config(config_path, config_flag)
    tied = bool(config_data.get("tie_word_embeddings", True))

    def target(name: str):
        source_is_float = name not in checkpoint.buffers or checkpoint.buffers[name].is_floating_point
        return out_dtype if source_is_float else checkpoint.buffers[name].dtype

    layout = [(name, tuple(checkpoint.shape(name)), target(name)) for name in checkpoint.names]
    aliases = {} if tied else {alias: source for alias, source in checkpoint.shared.items() if source in checkpoint.names}
    layout += [(alias, tuple(checkpoint.shape(source)), target(source)) for alias, source in aliases.items()]
    if not own_config:
        check_tensors_match(config_data, config_path, {name: shape for name, shape, _ in layout}, config_flag)
    written = 0
    with atomic_directory(out_dir, inputs=[ckpt_dir, config]) as tmp:
        writer = ShardedSafetensorsWriter(tmp, layout, max_bytes)
        with tqdm(total=writer.total, unit="B", unit_scale=True, desc="zero-to-hf",
                  disable=not progress or None) as bar:
            stream = checkpoint.sources()  # yields in checkpoint.names order, which is the layout's order
            kept = {}  # sources of aliases, written again at the end under the alias name
            for name, shape, dt in layout:
                if name in aliases:
                    source = kept[aliases[name]]
                else:
                    produced, source = next(stream)
                    assert produced == name, (produced, name)
                    if name in aliases.values():
                        kept[name] = source
                if isinstance(source, list) and dt == "float32":  # fp32 master bytes are the output bytes
                    ranges = [(lazy.path, lazy.offset + start * 4, count * 4) for lazy, start, count in source]
                    nbytes = writer.copy_ranges(name, shape, dt, ranges)
                else:
                    import torch

                    if isinstance(source, list):
                        pieces = [lazy.read(start, count) for lazy, start, count in source]
                        source = torch.cat(pieces).view(shape)
                    nbytes = writer.write(name, source.to(getattr(torch, dt)))
                written += nbytes
                bar.update(nbytes)
        writer.close()
        shutil.copyfile(config_path, tmp / "config.json")
        for side, path in sides.items():
            copy_side_file(path, tmp / side, ckpt_dir, "CKPT_DIR")
    shards = len(writer.shards)
    log.info("wrote %d tensors (%d bytes) in %d shard(s) to %s", len(layout), written, shards, out_dir)
    return ConversionResult(out_dir, len(layout), written, shards, checkpoint.stage, checkpoint.world_size)
