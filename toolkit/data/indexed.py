"""A Megatron indexed dataset (PREFIX.bin + PREFIX.idx) checked before Megatron-Core's reader opens it: the pair
present, the index's magic, version and dtype, its size against its counts, and the .bin's size against the tokens
the index says it holds. Anything wrong is one line naming the file; Megatron-Core's reader only asserts."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from toolkit.compat.megatron_datasets_seams import index_header
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
    if documents == 1:  # the leading 0 alone: GPTDataset and `dmt data inspect` have nothing to cut samples from
        raise UserInputError(flag, f"{idx} holds no documents; prepare it from an input with at least one")
    tokens = int(lengths.sum(dtype=numpy.int64))
    itemsize = numpy.dtype(dtype).itemsize
    # Megatron-Core reads sequence i at its pointer, not at the sum of the lengths before it: each pointer must be
    # where the lengths put it (as _IndexWriter writes them), or a read lands past the .bin or inside another sequence
    pointers = numpy.memmap(idx, dtype=numpy.int64, mode="r", offset=_FIXED.size + sequences * 4, shape=(sequences,))
    starts = numpy.concatenate([[0], numpy.cumsum(lengths[:-1], dtype=numpy.int64)]) * itemsize
    if not numpy.array_equal(pointers, starts):
        first = int(numpy.flatnonzero(pointers != starts)[0])
        raise UserInputError(flag, f"{idx}: sequence {first}'s pointer is byte {int(pointers[first])} of {bin_.name}, "
                                   f"not {int(starts[first])} where the lengths before it end; damaged")
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
    """Refuse, in one line naming `key` and the file, what under `directory` Megatron-Core's index cache must not
    find: anything but regular files and directories (a FIFO there blocks every rank that opens it, before any
    watchdog runs), and a `.npy` that holds pickled objects or no integers.

    Megatron-Core's GPTDataset and BlendedDataset read their index cache with numpy.load(allow_pickle=True): a cache
    directory someone else filled (a recipe's `data.cache_dir`, shared between jobs) could run code through an object
    array. The indices Megatron-Core writes are plain integer arrays, so an array of any other dtype is never one of
    them; numpy's header reader tells without unpickling anything. Their values are checked once the datasets are
    built (check_index_values)."""
    import os

    from numpy.lib import format as npy

    for root, directories, files in os.walk(directory):
        for name in sorted(directories + files):
            path = Path(root) / name
            kind = not_a_file(path)
            if kind is not None and not path.is_dir():
                raise UserInputError(key, f"{path} is {kind}, not a file of Megatron-Core's index cache (reading it "
                                          f"would block or fail on every rank); remove it")
    for path in sorted(Path(directory).rglob("*.npy")):
        try:
            # O_NONBLOCK: a FIFO put there since the walk above does not block the open
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as handle:
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
        if dtype.kind not in "iu":
            raise UserInputError(key, f"{path} holds {dtype} values, not the integers of an index Megatron-Core "
                                      f"writes; delete it and the cache is built again")


def _index_array(dataset, name: str):
    """An index array of a built Megatron-Core dataset; loaded (memory-mapped, no pickle) where the dataset loads it
    lazily."""
    import numpy

    array = getattr(dataset, name)
    return numpy.load(getattr(dataset, f"path_to_{name}"), mmap_mode="r", allow_pickle=False) if array is None \
        else array


def _cache_file(dataset, name: str) -> str:
    """The cache file Megatron-Core keeps index `name` of `dataset` in (its own naming: the description's hash, the
    class, the split), or the index's name where the dataset has no cache."""
    import os

    split = getattr(dataset, "index_split", None) or getattr(dataset, "split", None)
    if not dataset.config.path_to_cache or split is None:
        return name
    return os.path.join(dataset.config.path_to_cache, f"{dataset.unique_description_hash}-{type(dataset).__name__}-"
                                                      f"{split.name}-{name}.npy")


def check_index_values(dataset, key: str) -> None:
    """Every index of a built BlendedDataset or GPTDataset (read from the cache when it was there) points inside
    what it indexes: the dataset of each blended sample and its sample there, a shuffled sample, a sample's
    document and offset, a document of the indexed dataset. An index out of range (a damaged or foreign cache)
    would otherwise end in an IndexError inside a data loader worker, on every rank."""
    import numpy

    def check(name: str, values, low: int, high: int) -> None:
        if values.size and (int(values.min()) < low or int(values.max()) > high):
            where = _cache_file(dataset, name)
            raise UserInputError(key, f"{where} holds values {int(values.min())} to {int(values.max())}, outside "
                                      f"{low} to {high}: a damaged or foreign index cache; delete it and it is "
                                      f"built again")

    if hasattr(dataset, "datasets"):  # a BlendedDataset
        for part in dataset.datasets:
            check_index_values(part, key)
        check("dataset_index", _index_array(dataset, "dataset_index"), 0, len(dataset.datasets) - 1)
        check("dataset_sample_index", _index_array(dataset, "dataset_sample_index"), 0,
              max(len(part) for part in dataset.datasets) - 1)
        return
    samples, documents = _index_array(dataset, "sample_index"), _index_array(dataset, "document_index")
    check("shuffle_index", _index_array(dataset, "shuffle_index"), 0, max(0, samples.shape[0] - 2))
    check("document_index", documents, 0, len(dataset.dataset.sequence_lengths) - 1)  # GPTDataset: one per sequence
    if samples.ndim != 2 or samples.shape[1] != 2:
        check("sample_index", numpy.zeros(1), 1, 0)  # not the (samples + 1, 2) table of (document, offset) pairs
    check("sample_index", samples[:, 0], 0, max(0, documents.shape[0] - 1))
    check("sample_index", samples[:, 1], 0, int(dataset.dataset.sequence_lengths.max(initial=0)))
