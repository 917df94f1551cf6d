"""A safetensors file written tensor by tensor: the header is known up front, so no state dict is held in memory.

The format (safetensors' docs, "Format"): 8-byte little-endian header length, a JSON header mapping each name to
dtype, shape and [begin, end) byte offsets into the data that follows, padded with spaces to 8 bytes. Files written
here are read back with safetensors' own `safe_open` in the tests.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from toolkit.errors import UserInputError
from toolkit.readers import inside, link_root, open_regular, read_json, read_safetensors_header

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


def parse_size(text: str, flag: str = "--max-shard-size") -> int | str:
    """The largest shard as huggingface_hub's shard splitter takes it (what `save_pretrained`'s max_shard_size
    reads: 5GB, 500MB, 100KB, or a number of bytes), refused before any work starts if the splitter cannot read it."""
    value: int | str = int(text) if str(text).strip().isdigit() else str(text)
    try:
        _split({}, value)  # the splitter reads the size before it looks at any tensor
    except ValueError as exc:
        raise UserInputError(flag, f"{' '.join(str(exc).split())} A number of bytes works too.") from None
    return value


def _split(layout: dict[str, tuple], max_shard_size: int | str):
    """huggingface_hub's plan for `layout` (name -> (shape, dtype)), as `save_pretrained` plans a state dict: in
    order, a new shard when the next tensor would pass the limit, a tensor larger than the limit alone in a shard
    of its own; one file `model.safetensors`, else `model-0000i-of-0000n.safetensors`."""
    from huggingface_hub import split_state_dict_into_shards_factory

    return split_state_dict_into_shards_factory(layout, get_storage_size=lambda entry: tensor_bytes(*entry),
                                                filename_pattern="model{suffix}.safetensors",
                                                max_shard_size=max_shard_size)


class ShardedSafetensorsWriter:
    """HF's sharded layout, written tensor by tensor in `layout` order: the files and index `save_pretrained` writes
    for the same tensors (model.safetensors, or its shards and model.safetensors.index.json). A shard's file is
    opened at its first tensor and closed at its last; a shard of one oversized tensor is planned out of layout
    order (as huggingface_hub does), so two files may be open at once."""

    def __init__(self, out_dir: Path, layout: list[tuple[str, tuple, object]], max_shard_size: int | str):
        self.out_dir = out_dir
        entries = {name: (shape, dtype) for name, shape, dtype in layout}
        if len(entries) != len(layout):
            raise ValueError(f"{out_dir}: the layout names a tensor twice")
        self.split = _split(entries, max_shard_size)
        self.names = list(self.split.filename_to_tensors)
        self.shards = [[(name, *entries[name]) for name in names] for names in self.split.filename_to_tensors.values()]
        self.total = self.split.metadata["total_size"]
        self._open: dict[str, StreamingSafetensorsWriter] = {}
        self._closed = 0

    def _writer(self, name: str) -> StreamingSafetensorsWriter:
        file = self.split.tensor_to_filename.get(name)
        if file is None:
            raise ValueError(f"{self.out_dir}: {name} is not in the layout")
        if file not in self._open:
            self._open[file] = StreamingSafetensorsWriter(self.out_dir / file, self.shards[self.names.index(file)])
        return self._open[file]

    def _done(self, writer: StreamingSafetensorsWriter, count: int) -> int:
        if writer.complete:
            writer.close()
            del self._open[writer.path.name]
            self._closed += 1
        return count

    def write(self, name: str, tensor) -> int:
        writer = self._writer(name)
        return self._done(writer, writer.write(name, tensor))

    def copy_ranges(self, name: str, shape, dtype, ranges: list[tuple[Path, int, int]]) -> int:
        writer = self._writer(name)
        return self._done(writer, writer.copy_ranges(name, shape, dtype, ranges))

    def close(self) -> None:
        for writer in list(self._open.values()):
            writer.close()  # raises: a shard still open was never finished
        if self._closed != len(self.shards):
            raise ValueError(f"{self.out_dir}: {len(self.shards) - self._closed} shard(s) were never written")
        if self.split.is_sharded:
            parameters = sum(math.prod(shape) for shard in self.shards for _, shape, _ in shard)
            index = {"metadata": {"total_parameters": parameters, **self.split.metadata},
                     "weight_map": self.split.tensor_to_filename}
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
        root = link_root(model_dir)  # a shard may link elsewhere inside the hub cache's repository, nowhere else
        for file in sorted(set(weight_map.values())):
            inside(root, (model_dir / file).relative_to(root), key, "a safetensors shard inside the model directory")
        return weight_map
    if (model_dir / "model.safetensors").is_file():
        inside(link_root(model_dir), (model_dir / "model.safetensors").relative_to(link_root(model_dir)), key,
               "a safetensors file inside the model directory")
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
