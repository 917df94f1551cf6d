"""Index the tensors of a `torch.save` file without reading their data, then read byte ranges of them on demand.

torch.save writes a zip archive: `<name>/data.pkl` (the pickled object, tensors as references to storages) and one
uncompressed entry `<name>/data/<key>` per storage. Unpickling with the tensor rebuild functions replaced yields
LazyTensor placeholders that know their file offset, so a converter reads exactly the bytes it needs with pread:
peak memory is the tensor being built, not the file (which torch.load, even with mmap, leaves resident).

Indexing imports no torch: the storage classes, torch.Size and torch.Tensor that DeepSpeed's files reference are
stood in for, and dtypes are names ("float32"), so a converter that only copies bytes never pays torch's import
(~1.5 s, and its memory). Reading a tensor imports it.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

from toolkit.checkpoint.allow_lists import DEEPSPEED, Refused, RestrictedUnpickler, refusal
from toolkit.errors import UserInputError
from toolkit.readers import open_regular, problem

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes
_LOCAL_HEADER_SIGNATURE = 0x04034B50
_ZIP_MAGIC = b"PK\x03\x04"  # what torch.load looks for at the start to read a file as a zip (serialization._is_zipfile)


# torch's legacy typed storage classes (what torch.save pickles as a storage's type) -> dtype name, bytes
STORAGE_DTYPES = {
    "FloatStorage": ("float32", 4), "DoubleStorage": ("float64", 8), "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2), "LongStorage": ("int64", 8), "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2), "CharStorage": ("int8", 1), "ByteStorage": ("uint8", 1), "BoolStorage": ("bool", 1),
}
ITEMSIZE = dict(STORAGE_DTYPES.values())
FLOATING = {"float32", "float64", "float16", "bfloat16"}


@dataclass(frozen=True)
class _Storage:
    """Stands for torch.<X>Storage while unpickling: its dtype name."""

    dtype: str


@dataclass(frozen=True)
class LazyTensor:
    """A contiguous tensor stored in `path` at byte `offset`: only shape and dtype (a name) are known until read."""

    path: Path
    offset: int
    dtype: str
    shape: tuple

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_floating_point(self) -> bool:
        return self.dtype in FLOATING

    def read(self, start: int = 0, count: int | None = None):
        """Elements [start, start + count) of the flattened tensor, as a new 1-D torch tensor."""
        import torch

        count = self.numel() - start if count is None else count
        itemsize = ITEMSIZE[self.dtype]
        first = self.offset + start * itemsize
        # the shape comes from the pickle: the file must hold what it claims before a buffer that size is allocated
        with open_regular(self.path, None, "a torch.save file", end=first + count * itemsize) as handle:
            data = os.pread(handle.fileno(), count * itemsize, first)
        if len(data) != count * itemsize:
            raise UserInputError(str(self.path), f"ends early: {len(data)} of {count * itemsize} bytes (truncated)")
        return torch.frombuffer(bytearray(data), dtype=getattr(torch, self.dtype))

    def load(self):
        return self.read().view(self.shape)


class Opaque:
    """Stand-in for a class of another library inside a checkpoint (e.g. DeepSpeed's ZeroStageEnum, LossScaler).

    Keeps constructor arguments and state, so values such as an enum's int survive without importing the library.
    """

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state):
        self.state = state

    def __int__(self) -> int:
        return int(self.args[0])

    def __repr__(self) -> str:
        return f"Opaque{self.args}"


def _opaque_class(module: str, name: str) -> type:
    return type(name, (Opaque,), {"__module__": module})


class _IndexUnpickler(RestrictedUnpickler):
    """A RestrictedUnpickler (safe_load.py) of one format's allow-list whose tensors become LazyTensors; of the
    classes allowed, those of other libraries (DeepSpeed's ZeroStageEnum, numpy's arrays, pathlib) are stood in
    for, never imported."""

    def __init__(self, handle, path: Path, offsets: dict[str, int], allowed: frozenset):
        super().__init__(handle, allowed)
        self._path = path
        self._offsets = offsets

    def find_class(self, module: str, name: str):
        module, name = self.check(module, name)
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self._rebuild_tensor
        if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):
            return lambda func, new_type, args, state: func(*args)
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return lambda data, requires_grad, backward_hooks: data
        if module == "torch" and name in STORAGE_DTYPES:
            return _Storage(STORAGE_DTYPES[name][0])
        if (module, name) == ("torch", "Size"):
            return tuple
        if (module, name) == ("torch", "Tensor"):  # _rebuild_from_type_v2's new_type, unused here
            return _opaque_class(module, name)
        if module not in ("torch", "collections", "builtins", "_codecs"):
            return _opaque_class(module, name)  # no need to import DeepSpeed (seconds) to read its checkpoints
        return pickle.Unpickler.find_class(self, module, name)  # the allowed builtins and containers themselves

    def persistent_load(self, pid):
        _, storage_type, key, _location, _numel = pid
        if isinstance(storage_type, _Storage):
            dtype = storage_type.dtype
        else:  # a storage class not in STORAGE_DTYPES: torch was imported to resolve it
            with warnings.catch_warnings():  # legacy typed-storage classes warn on attribute access
                warnings.simplefilter("ignore")
                dtype = str(storage_type.dtype).removeprefix("torch.")
        if dtype not in ITEMSIZE:
            raise ValueError(f"storage of dtype {dtype} is not supported")
        return self._offsets[key], dtype

    def _rebuild_tensor(self, storage, storage_offset, size, stride, *_):
        offset, dtype = storage
        size = tuple(size)
        if tuple(stride) != _contiguous_strides(size) and math.prod(size) > 1:
            raise ValueError(f"{self._path}: non-contiguous tensor of shape {size} is not supported")
        return LazyTensor(self._path, offset + storage_offset * ITEMSIZE[dtype], dtype, size)


def _contiguous_strides(size: tuple) -> tuple:
    strides, step = [], 1
    for dim in reversed(size):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def check_stored(archive: zipfile.ZipFile, path: Path, key: str | None) -> None:
    """Every record of a torch.save archive stored, as torch.save writes them (its zip writer never compresses): a
    compressed record (a kilobyte can inflate to gigabytes, which torch's reader and zipfile would both allocate) is
    refused unread, in one line. A stored record's bytes are its own, bounded by the file."""
    for info in archive.infolist():
        if info.compress_type != zipfile.ZIP_STORED:
            raise problem(Path(path), key, f"holds the compressed record {info.filename} ({info.compress_size} bytes "
                                           f"said to inflate to {info.file_size}); torch.save stores every record "
                                           f"uncompressed: refused unread")
        if info.file_size != info.compress_size:
            raise problem(Path(path), key, f"holds the record {info.filename} of {info.compress_size} bytes said to "
                                           f"hold {info.file_size} (corrupt): refused unread")


def index_torch_file(path: Path, region: tuple[int, int] | None = None, allowed: frozenset = DEEPSPEED,
                     key: str | None = None, root: Path | None = None):
    """The object saved in `path` (or in its bytes [offset, offset + length) when `region` is given: one torch.save
    archive inside a DCP .distcp file), with every tensor replaced by a LazyTensor, unpickled with the `allowed`
    globals only (safe_load.py). `path` must be a regular file (inside `root`, symlinks resolved, when given).
    Damaged files, compressed records, and globals outside `allowed`, raise UserInputError (naming `key`, or the
    file)."""
    start, length = region or (0, None)
    try:
        end = None if region is None else start + length
        with open_regular(path, key, "a torch.save file", root, end) as handle:
            return _index(path, handle, start, length, allowed, key)
    except UserInputError:
        raise
    except Refused as exc:
        raise refusal(path, key, exc.name, exc.allowed) from None
    except Exception as exc:  # zipfile, pickle and struct errors all mean a damaged file
        fault = f"{path} cannot" if key else "cannot"
        raise UserInputError(key or str(path), f"{fault} be read, truncated or corrupt ({type(exc).__name__}: "
                                               f"{exc})") from None


def check_one_archive(archive: zipfile.ZipFile, raw) -> str:
    """The name of the pickle torch.load unpickles from `archive` (open on `raw`), once the archive is one torch.load
    reads as this module does: starting at byte 0 with a zip record (torch.load unpickles anything else as a
    legacy pickle, so a pickle with a harmless zip appended would run while the zip is scanned), every record in
    the one folder of the first (torch names the archive after it) and no name twice (zipfile reads the last of
    two, torch's reader may read the first). Otherwise a ValueError saying which."""
    raw.seek(0)
    if raw.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
        raise ValueError("does not start with a zip record as torch.save writes it (torch.load would unpickle it "
                         "as a legacy pickle)")
    records = archive.infolist()
    if not records or records[0].header_offset != 0:
        raise ValueError("has bytes before its first zip record")
    names = [info.filename for info in records]
    folder = names[0].split("/", 1)[0] + "/" if "/" in names[0] else ""
    if len(set(names)) != len(names) or not all(name.startswith(folder) for name in names):
        raise ValueError(f"holds records outside one folder or a name twice; torch.save writes one folder "
                         f"({folder or 'the top'}) of unique names")
    if folder + "data.pkl" not in names:
        raise ValueError(f"has no {folder}data.pkl")
    return folder + "data.pkl"


def _index(path: Path, handle, start: int, length: int | None, allowed: frozenset, key: str | None):
    raw = handle if length is None else FileSlice(handle, start, length)
    end = start + (length if length is not None else os.fstat(handle.fileno()).st_size)
    with zipfile.ZipFile(raw) as archive:
        check_stored(archive, path, key)
        pickle_name = check_one_archive(archive, raw)
        prefix = pickle_name[: -len("data.pkl")]
        offsets = {}
        for info in archive.infolist():
            if info.filename.startswith(prefix + "data/"):
                raw.seek(info.header_offset)
                header = _LOCAL_HEADER.unpack(raw.read(_LOCAL_HEADER.size))
                if header[0] != _LOCAL_HEADER_SIGNATURE:
                    raise ValueError(f"bad local header for {info.filename}")
                data_offset = start + info.header_offset + _LOCAL_HEADER.size + header[9] + header[10]
                if data_offset + info.file_size > end:
                    raise ValueError(f"storage {info.filename} runs past the end of the file")
                offsets[info.filename[len(prefix) + len("data/"):]] = data_offset
        with archive.open(pickle_name) as pickled:
            return _IndexUnpickler(pickled, path, offsets, allowed).load()


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
