"""Megatron-Core's datasets where the toolkit goes past their public calls: whole batches of documents appended to an
`IndexedDatasetBuilder` at once (its `add_document` takes one), the index file's magic, which its reader only asserts,
and the index cache GPTDataset and BlendedDataset read with numpy.load(allow_pickle=True), read without pickles."""

from __future__ import annotations

from array import array

from toolkit.compat import Seam

_INDEXED = "megatron.core.datasets.indexed_dataset"
_CACHE_READERS = ("megatron.core.datasets.gpt_dataset", "megatron.core.datasets.blended_dataset")
_WHY_BATCH = ("append_documents writes a batch of documents as add_document writes one (its three statements, over "
              "many documents at once); add_document's numpy conversion and write per document cost more than the "
              "tokenizer's batch encode")
SEAMS = [
    Seam("megatron-core", f"{_INDEXED}._INDEX_HEADER",
         "the .idx magic `dmt data inspect` checks before opening an index: Megatron-Core's reader only asserts it "
         "(a traceback, not a line naming the file)"),
    Seam("megatron-core", f"{_INDEXED}.IndexedDatasetBuilder.data_file", _WHY_BATCH, kind="in_source"),
    Seam("megatron-core", f"{_INDEXED}.IndexedDatasetBuilder.sequence_lengths", _WHY_BATCH, kind="in_source"),
    Seam("megatron-core", f"{_INDEXED}.IndexedDatasetBuilder.document_indices", _WHY_BATCH, kind="in_source"),
    *(Seam("megatron-core", f"{module}.numpy",
           "the module's numpy, replaced by index_cache_without_pickles: it reads the index cache (data.cache_dir, "
           "which other jobs may share) with numpy.load(allow_pickle=True), so a file swapped for a pickle after "
           "check_plain_arrays read it would run code; the replacement loads with allow_pickle=False")
      for module in _CACHE_READERS),
]


def index_header() -> bytes:
    """The magic an .idx file starts with (b"MMIDIDX\\x00\\x00" in 0.16)."""
    from megatron.core.datasets import indexed_dataset

    return indexed_dataset._INDEX_HEADER


def indexed_dataset_builder(bin_path: str, dtype):
    """Megatron-Core's own builder writing `bin_path`, its per-sequence and per-document lists kept as machine
    integers (8 bytes an entry, a Python int list's fifth): the index of a billion-token corpus stays small. Its
    finalize writes them through numpy as it writes lists."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(bin_path, dtype=dtype)
    builder.sequence_lengths = array("q", builder.sequence_lengths)
    builder.document_indices = array("q", builder.document_indices)
    return builder


def append_documents(builder, tokens, sequence_lengths, sequences_per_document) -> None:
    """Append documents to `builder` as add_document(tokens, lengths) would one by one: `tokens` the documents' ids
    end to end (a numpy array of the builder's dtype), `sequence_lengths` every sequence's length in order, and
    `sequences_per_document` how many of those sequences each document holds (0 for an empty document)."""
    import numpy

    builder.data_file.write(numpy.ascontiguousarray(tokens, dtype=builder.dtype).tobytes(order="C"))
    ends = builder.document_indices[-1]  # the sequences written so far: add_document appends that count
    builder.sequence_lengths.frombytes(numpy.asarray(sequence_lengths, dtype=numpy.int64).tobytes())
    builder.document_indices.frombytes((ends + numpy.cumsum(sequences_per_document, dtype=numpy.int64)).tobytes())


class _NumpyWithoutPickles:
    """numpy as a dataset module sees it, whose load never unpickles (allow_pickle=False whatever the caller asks):
    the index cache holds integer arrays only, which numpy memory-maps without pickles."""

    def __init__(self, numpy):
        self.numpy = numpy

    def __getattr__(self, name: str):
        return getattr(self.numpy, name)

    def load(self, *args, **kwargs):
        return self.numpy.load(*args, **{**kwargs, "allow_pickle": False})


def index_cache_without_pickles() -> None:
    """GPTDataset's and BlendedDataset's index cache reads refuse a pickle (numpy's ValueError) instead of loading
    it; idempotent, for the process."""
    import importlib

    for name in _CACHE_READERS:
        module = importlib.import_module(name)
        if not isinstance(module.numpy, _NumpyWithoutPickles):
            module.numpy = _NumpyWithoutPickles(module.numpy)
