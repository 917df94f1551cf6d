"""DeepSpeed ZeRO checkpoint -> HF safetensors (sharded, with index) + config, streamed one tensor at a time."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from toolkit.checkpoint.atomic import atomic_directory
from toolkit.checkpoint.deepspeed_zero import open_zero_checkpoint
from toolkit.checkpoint.safetensors_stream import ShardedSafetensorsWriter, parse_size
from toolkit.errors import UserInputError

log = logging.getLogger(__name__)

# Files next to an HF Trainer checkpoint that from_pretrained users expect to travel with the weights.
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


@dataclass(frozen=True)
class ConversionResult:
    out_dir: Path
    tensors: int
    bytes_written: int
    shards: int
    stage: int
    world_size: int


def find_config(ckpt_dir: Path, tag_dir: Path, config: Path | None) -> Path:
    if config is not None:
        path = config / "config.json" if config.is_dir() else config
        if not path.is_file():
            raise UserInputError("--config", f"{config} is not an HF config.json or a directory with one")
        return path
    for candidate in (tag_dir / "config.json", ckpt_dir / "config.json", ckpt_dir.parent / "config.json"):
        if candidate.is_file():
            return candidate
    raise UserInputError("--config", f"no config.json next to {ckpt_dir}; pass --config PATH/config.json")


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
    checkpoint = open_zero_checkpoint(ckpt_dir, tag)
    config_path = find_config(ckpt_dir, checkpoint.tag_dir, config)
    try:
        config_data = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserInputError(str(config_path), f"not a readable JSON config ({exc})") from None
    tied = bool(config_data.get("tie_word_embeddings", True))

    def target(name: str):
        source_is_float = name not in checkpoint.buffers or checkpoint.buffers[name].is_floating_point
        return out_dtype if source_is_float else checkpoint.buffers[name].dtype

    layout = [(name, tuple(checkpoint.shape(name)), target(name)) for name in checkpoint.names]
    aliases = {} if tied else {alias: source for alias, source in checkpoint.shared.items() if source in checkpoint.names}
    layout += [(alias, tuple(checkpoint.shape(source)), target(source)) for alias, source in aliases.items()]
    written = 0
    with atomic_directory(out_dir) as tmp:
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
        for side in SIDE_FILES:
            for folder in (checkpoint.tag_dir, ckpt_dir):
                if (folder / side).is_file():
                    shutil.copyfile(folder / side, tmp / side)
                    break
    shards = len(writer.shards)
    log.info("wrote %d tensors (%d bytes) in %d shard(s) to %s", len(layout), written, shards, out_dir)
    return ConversionResult(out_dir, len(layout), written, shards, checkpoint.stage, checkpoint.world_size)
