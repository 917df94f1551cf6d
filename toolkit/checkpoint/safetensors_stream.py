"""A safetensors file written tensor by tensor: the header is known up front, so no state dict is held in memory.

The format (safetensors' docs, "Format"): 8-byte little-endian header length, a JSON header mapping each name to
dtype, shape and [begin, end) byte offsets into the data that follows, padded with spaces to 8 bytes. Files written
here are read back with safetensors' own `safe_open` in the tests.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

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
        self._handle = open(path, "wb")
        self._handle.write(struct.pack("<Q", len(encoded)))
        self._handle.write(encoded)
        self._next = 0

    def write(self, name: str, tensor) -> int:
        expected, shape, dtype = self.layout[self._next]
        if name != expected or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(f"expected {expected} {tuple(shape)} {dtype}, got {name} {tuple(tensor.shape)} {tensor.dtype}")
        data = tensor.detach().contiguous().cpu().reshape(-1).view(dtype=_byte_view_dtype()).numpy()
        self._handle.write(memoryview(data))
        self._next += 1
        return data.nbytes

    def close(self) -> None:
        if self._next != len(self.layout):
            self._handle.close()
            raise ValueError(f"{self.path}: {len(self.layout) - self._next} tensors were never written")
        self._handle.close()


def _byte_view_dtype():
    import torch

    return torch.uint8
