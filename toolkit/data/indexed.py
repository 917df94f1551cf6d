"""A Megatron indexed dataset (PREFIX.bin + PREFIX.idx) checked before Megatron-Core's reader opens it: the pair
present, the index's magic, version and dtype, its size against its counts, and the .bin's size against the tokens
the index says it holds. Anything wrong is one line naming the file; Megatron-Core's reader only asserts."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import UserInputError
from toolkit.readers import not_a_file, one_line

# the index layout of megatron.core.datasets.indexed_dataset (_IndexWriter): magic (9 bytes), version (<Q, 1),
# dtype code (<B), sequence count (<Q), document count (<Q); then int32 sequence lengths, int64 sequence pointers,
# int64 document indices (and int8 modes, multimodal only)
_FIXED = struct.Struct("<9sQBQQ")
INDEX_VERSION = 1


@dataclass(frozen=True)
class IndexedFiles:
    prefix: str
    dtype: str  # numpy's name of the token dtype
    sequences: int
    documents: int  # as Megatron-Core counts them: entries of the document index less its leading 0
    tokens: int


def check_pair(prefix: str, flag: str) -> IndexedFiles:
    """The counts of the dataset at `prefix`, once its .idx and .bin agree with each other."""
    import numpy
    from megatron.core.datasets.indexed_dataset import DType

    from toolkit.compat.megatron_datasets_seams import index_header

    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for path in (idx, bin_):
        if not path.exists():
            other = bin_ if path == idx else idx
            raise UserInputError(flag, f"{path} is missing{' (its ' + other.name + ' is there)' if other.exists() else ''}"
                                       f"; a Megatron dataset is a .bin and .idx pair")
        if not_a_file(path):
            raise UserInputError(flag, f"{path} is {not_a_file(path)}, not a regular file")
    idx_size, bin_size = idx.stat().st_size, bin_.stat().st_size
    with open(idx, "rb") as handle:
        head = handle.read(_FIXED.size)
    if len(head) < _FIXED.size:
        raise UserInputError(flag, f"{idx} holds {idx_size} bytes, less than an index header ({_FIXED.size}); "
                                   f"truncated or not a Megatron index")
    magic, version, code, sequences, documents = _FIXED.unpack(head)
    if magic != index_header():
        raise UserInputError(flag, f"{idx} does not start with a Megatron index's magic {index_header()!r} "
                                   f"(found {magic!r}); not a Megatron .idx file")
    if version != INDEX_VERSION:
        raise UserInputError(flag, f"{idx} is index version {version}; Megatron-Core reads version {INDEX_VERSION}")
    try:
        dtype = DType.dtype_from_code(code)
    except ValueError:
        raise UserInputError(flag, f"{idx} names token dtype code {code}, which Megatron-Core does not know "
                                   f"(codes {', '.join(str(d.value) for d in DType)})") from None
    expected = _FIXED.size + sequences * (4 + 8) + documents * 8
    if idx_size != expected:
        raise UserInputError(flag, f"{idx} holds {idx_size} bytes; its header ({sequences} sequences, {documents} "
                                   f"document indices) makes {expected}: truncated or damaged")
    lengths, ends = _index_arrays(idx, sequences, documents)
    if documents == 0 or ends[0] != 0 or ends[-1] != sequences or (numpy.diff(ends) < 0).any() or (lengths < 0).any():
        raise UserInputError(flag, f"{idx}: its document index does not run from 0 up to its {sequences} sequences; "
                                   f"damaged")
    tokens = int(lengths.sum(dtype=numpy.int64))
    itemsize = numpy.dtype(dtype).itemsize
    if bin_size != tokens * itemsize:
        what = "truncated" if bin_size < tokens * itemsize else "longer than its index says"
        raise UserInputError(flag, f"{bin_} holds {bin_size} bytes; its index ({idx.name}) says {tokens} tokens of "
                                   f"{itemsize} bytes ({tokens * itemsize}): {what}")
    return IndexedFiles(str(prefix), numpy.dtype(dtype).name, int(sequences), int(documents) - 1, tokens)


def _index_arrays(idx: Path, sequences: int, documents: int):
    """(sequence lengths, document indices) of an index, memory-mapped (empty arrays for none)."""
    import numpy

    lengths = numpy.memmap(idx, dtype=numpy.int32, mode="r", offset=_FIXED.size, shape=(sequences,)) \
        if sequences else numpy.zeros(0, dtype=numpy.int32)
    ends = numpy.memmap(idx, dtype=numpy.int64, mode="r", offset=_FIXED.size + sequences * 12, shape=(documents,)) \
        if documents else numpy.zeros(0, dtype=numpy.int64)
    return lengths, ends


def prefix_document_lengths(prefix: str, flag: str):
    """Tokens per document of the dataset at `prefix` (after check_pair), read from its .idx alone: no .bin read and
    no Megatron-Core reader built, so an estimate can afford it for a corpus of any size."""
    files = check_pair(prefix, flag)
    lengths, ends = _index_arrays(Path(f"{prefix}.idx"), files.sequences, files.documents + 1)
    return _document_totals(lengths, ends)


def open_indexed(prefix: str, flag: str):
    """Megatron-Core's IndexedDataset of `prefix`, after check_pair."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    check_pair(prefix, flag)
    return IndexedDataset(str(prefix))


def document_lengths(dataset):
    """Tokens per document of an IndexedDataset (an empty document counts 0)."""
    return _document_totals(dataset.sequence_lengths, dataset.document_indices)


def _document_totals(sequence_lengths, document_indices):
    """Tokens per document from an index's sequence lengths and document indices (the sequences each ends at)."""
    import numpy

    totals = numpy.concatenate([[0], numpy.cumsum(sequence_lengths, dtype=numpy.int64)])
    return totals[document_indices[1:]] - totals[document_indices[:-1]]


def document_tokens(dataset, document: int):
    """The token ids of one document, its sequences end to end."""
    import numpy

    first, last = dataset.document_indices[document], dataset.document_indices[document + 1]
    parts = [dataset[int(i)] for i in range(first, last)]
    return numpy.concatenate(parts) if parts else numpy.zeros(0, dtype=numpy.int64)


def check_plain_arrays(directory: Path, key: str) -> None:
    """Refuse, in one line naming `key` and the file, a `.npy` under `directory` that holds pickled objects.

    Megatron-Core's GPTDataset and BlendedDataset read their index cache with numpy.load(allow_pickle=True): a cache
    directory someone else filled (a recipe's `data.cache_dir`, shared between jobs) could run code through an object
    array. The indices Megatron-Core writes are plain integer arrays, so an array whose dtype holds objects is never
    one of them; numpy's header reader tells without unpickling anything."""
    from numpy.lib import format as npy

    for path in sorted(Path(directory).rglob("*.npy")):
        try:
            with path.open("rb") as handle:
                version = npy.read_magic(handle)
                header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
                _, _, dtype = header(handle)
        except (OSError, ValueError) as exc:
            raise UserInputError(key, f"{path} is not a readable numpy index ({one_line(str(exc))}); delete it and "
                                      f"the cache is built again") from None
        if dtype.hasobject:
            raise UserInputError(key, f"{path} holds pickled Python objects (dtype {dtype}), not an index "
                                      f"Megatron-Core writes; refusing to load it (delete it and the cache is built "
                                      f"again)")
