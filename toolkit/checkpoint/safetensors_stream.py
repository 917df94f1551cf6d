"""A safetensors file written tensor by tensor: the header is known up front, so no state dict is held in memory.

The format (safetensors' docs, "Format"): 8-byte little-endian header length, a JSON header mapping each name to
dtype, shape and [begin, end) byte offsets into the data that follows, padded with spaces to 8 bytes. Files written
here are read back with safetensors' own `safe_open` in the tests.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path

from toolkit.errors import UserInputError
from toolkit.readers import open_regular, read_json, read_safetensors_header

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)
# torch dtype name -> (safetensors dtype, bytes per element)
DTYPES = {
    "float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2), "float64": ("F64", 8),
    "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2), "int8": ("I8", 1), "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
}


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(shape, dtype) -> int:
    return math.prod(shape) * DTYPES[_dtype_name(dtype)][1]


class StreamingSafetensorsWriter:
    """Write tensors, in the announced order, into one safetensors file."""

    def __init__(self, path: Path, layout: list[tuple[str, tuple, object]], metadata: dict[str, str] | None = None):
        self.path = path
        self.layout = layout
        header: dict = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        for name, shape, dtype in layout:
            size = tensor_bytes(shape, dtype)
            header[name] = {"dtype": DTYPES[_dtype_name(dtype)][0], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._write_all(struct.pack("<Q", len(encoded)) + encoded)
        self._next = 0

    def _expect(self, name: str, shape, dtype) -> None:
        expected, want_shape, want_dtype = self.layout[self._next]
        if name != expected or tuple(shape) != tuple(want_shape) or _dtype_name(dtype) != _dtype_name(want_dtype):
            raise ValueError(f"expected {expected} {tuple(want_shape)} {want_dtype}, got {name} {tuple(shape)} {dtype}")

    def _write_all(self, data) -> None:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(self._fd, view):]

    def write(self, name: str, tensor) -> int:
        """Append one tensor's bytes (it must be the next one of the layout)."""
        self._expect(name, tensor.shape, tensor.dtype)
        data = tensor.detach().contiguous().cpu().reshape(-1).view(dtype=_byte_view_dtype()).numpy()
        self._write_all(data)
        self._next += 1
        return data.nbytes

    def copy_ranges(self, name: str, shape, dtype, ranges: list[tuple[Path, int, int]]) -> int:
        """Append a tensor whose bytes already lie in other files, as (path, byte offset, byte count) pieces.

        The kernel copies them (copy_file_range): no byte passes through this process.
        """
        self._expect(name, shape, dtype)
        total = 0
        for path, offset, count in ranges:
            with open_regular(path, None, "a checkpoint file", end=offset + count) as handle:
                done = 0
                while done < count:
                    copied = _copy_range(handle.fileno(), self._fd, count - done, offset + done)
                    if copied == 0:
                        raise ValueError(f"{path} ends before byte {offset + count} (truncated)")
                    done += copied
            total += count
        if total != tensor_bytes(shape, dtype):
            raise ValueError(f"{name}: pieces hold {total} bytes, the tensor needs {tensor_bytes(shape, dtype)}")
        self._next += 1
        return total

    def close(self) -> None:
        os.close(self._fd)
        if not self.complete:
            raise ValueError(f"{self.path}: {len(self.layout) - self._next} tensors were never written")

    @property
    def complete(self) -> bool:
        """Every tensor of the layout has been written."""
        return self._next == len(self.layout)


def parse_size(text: str, flag: str = "--max-shard-size") -> int:
    """'5GB' -> 5e9 bytes, '500MiB' -> 500 * 2^20, as HF's max_shard_size reads them."""
    match = _SIZE.match(str(text))
    if not match:
        raise UserInputError(flag, f"'{text}' is not a size; use e.g. 5GB, 500MB, 2GiB")
    number, unit, binary = float(match.group(1)), match.group(2).upper(), match.group(3)
    power = "KMGT".index(unit) + 1 if unit else 0
    size = int(number * (1024 if binary else 1000) ** power)
    if size <= 0:
        raise UserInputError(flag, f"must be positive, got {text}")
    return size


def plan_shards(layout: list[tuple[str, tuple, object]], max_bytes: int) -> list[list[tuple[str, tuple, object]]]:
    """Greedy split in layout order; a tensor larger than the limit gets a shard of its own (as HF does)."""
    shards: list[list] = [[]]
    size = 0
    for entry in layout:
        nbytes = tensor_bytes(entry[1], entry[2])
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


class ShardedSafetensorsWriter:
    """HF's sharded layout, written tensor by tensor in `layout` order: model.safetensors when one shard holds
    everything, else model-0000i-of-0000n.safetensors and model.safetensors.index.json (as `save_pretrained`)."""

    def __init__(self, out_dir: Path, layout: list[tuple[str, tuple, object]], max_bytes: int):
        self.out_dir = out_dir
        self.shards = plan_shards(layout, max_bytes)
        count = len(self.shards)
        self.names = (["model.safetensors"] if count == 1 else
                      [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)])
        self.total = sum(tensor_bytes(shape, dtype) for _, shape, dtype in layout)
        self._shard, self._writer = -1, None

    def _current(self) -> StreamingSafetensorsWriter:
        if self._writer is None or self._writer.complete:
            if self._writer is not None:
                self._writer.close()
            self._shard += 1
            self._writer = StreamingSafetensorsWriter(self.out_dir / self.names[self._shard], self.shards[self._shard])
        return self._writer

    def write(self, name: str, tensor) -> int:
        return self._current().write(name, tensor)

    def copy_ranges(self, name: str, shape, dtype, ranges: list[tuple[Path, int, int]]) -> int:
        return self._current().copy_ranges(name, shape, dtype, ranges)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._shard != len(self.shards) - 1:
            raise ValueError(f"{self.out_dir}: {len(self.shards) - 1 - self._shard} shard(s) were never written")
        if len(self.shards) > 1:
            weight_map = {name: file for file, shard in zip(self.names, self.shards) for name, _, _ in shard}
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def safetensors_weight_map(model_dir: Path, key: str | None = None) -> dict[str, str] | None:
    """Tensor name -> file of an HF model directory in the layout above (None when it has neither
    model.safetensors.index.json nor model.safetensors); a damaged index is a UserInputError naming it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        what = 'a safetensors index: {"weight_map": {"<tensor>": "<file in this directory>", ...}}'
        weight_map = read_json(index, key, what=what).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) and Path(v).name == v and v.endswith(".safetensors") for v in weight_map.values()):
            raise UserInputError(key or str(index), f"{index}: its weight_map is not {what}")
        return weight_map
    if (model_dir / "model.safetensors").is_file():
        return dict.fromkeys(read_safetensors_header(model_dir / "model.safetensors", key), "model.safetensors")
    return None


def _copy_range(source: int, target: int, count: int, offset: int) -> int:
    if hasattr(os, "copy_file_range"):
        try:
            return os.copy_file_range(source, target, min(count, 1 << 30), offset)
        except OSError:
            pass  # e.g. across filesystems on old kernels: fall back to read + write
    data = os.pread(source, min(count, 1 << 26), offset)
    view = memoryview(data)
    while view:
        view = view[os.write(target, view):]
    return len(data)


def _byte_view_dtype():
    import torch

    return torch.uint8
