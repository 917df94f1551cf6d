"""`dmt data inspect PREFIX`: what a prepared prefix holds (documents, tokens, dtype, document-length percentiles,
the first document decoded when the sidecar names its tokenizer), every dataset checked first."""

from __future__ import annotations

from pathlib import Path

from toolkit.data import sidecar
from toolkit.data.indexed import check_pair, document_lengths, document_tokens, open_indexed
from toolkit.data.tokenizer import identity, load_tokenizer
from toolkit.errors import UserInputError

PERCENTILES = (50, 90, 99)
FIRST_DOCUMENT_CHARS = 2000  # of the first document's decoded text, at most


def inspect(prefix: str, flag: str = "PREFIX") -> dict:
    """{"prefix", "sidecar" (its path or None), "tokenizer", "datasets": {key: summary}}. PREFIX is what `dmt data
    prepare --output-prefix` was given (its sidecar names the datasets), or one Megatron dataset prefix
    (PREFIX.bin/.idx, from Megatron-LM's own tool, say)."""
    record_path = sidecar.sidecar_path(prefix)
    if record_path.exists():
        record = sidecar.read_sidecar(prefix, flag)
        datasets = {key: entry["prefix"] for key, entry in record["datasets"].items()}
        tokenizer = record.get("tokenizer")
    elif Path(f"{prefix}.idx").exists() or Path(f"{prefix}.bin").exists():
        datasets, tokenizer = {Path(prefix).name: str(prefix)}, None
    else:
        raise UserInputError(flag, f"{prefix}: no {record_path.name}, {Path(prefix).name}.bin or "
                                   f"{Path(prefix).name}.idx there; give the --output-prefix of `dmt data prepare` "
                                   f"or a Megatron dataset prefix")
    for dataset_prefix in datasets.values():  # every pair sound before any is summarised
        check_pair(dataset_prefix, flag)
    decoder = _decoder(tokenizer)
    return {"prefix": str(prefix), "sidecar": str(record_path) if record_path.exists() else None,
            "tokenizer": {k: tokenizer.get(k) for k in ("path", "vocab_size", "sha256")} if tokenizer else None,
            "datasets": {key: _summary(path, flag, decoder) for key, path in datasets.items()}}


def _decoder(tokenizer: dict | None):
    """A function of token ids to text when the sidecar's tokenizer is still there with the same files, else a
    string saying why nothing is decoded."""
    if tokenizer is None:
        return "no sidecar names a tokenizer"

    directory = Path(tokenizer["path"])
    if not directory.is_dir():
        return f"the tokenizer {directory} is no longer there"
    try:
        loaded = load_tokenizer(directory)
    except UserInputError as exc:
        return f"the tokenizer {directory} does not load ({exc.message[:200]})"
    if identity(directory, loaded)["sha256"] != tokenizer.get("sha256"):
        return f"the tokenizer files in {directory} changed since the data was prepared"
    return lambda ids: loaded.tokenizer.decode(ids.tolist())


def _summary(dataset_prefix: str, flag: str, decoder) -> dict:
    import numpy

    dataset = open_indexed(dataset_prefix, flag)
    lengths = document_lengths(dataset)
    summary = {"files": [f"{dataset_prefix}.bin", f"{dataset_prefix}.idx"], "dtype": numpy.dtype(dataset.index.dtype).name,
               "documents": int(len(lengths)), "sequences": int(len(dataset.sequence_lengths)),
               "tokens": int(lengths.sum()), "empty_documents": int((lengths == 0).sum())}
    if len(lengths):
        summary["document_tokens"] = {"min": int(lengths.min()), "mean": round(float(lengths.mean()), 1),
                                      **{f"p{q}": float(numpy.percentile(lengths, q)) for q in PERCENTILES},
                                      "max": int(lengths.max())}
        first = document_tokens(dataset, 0)
        summary["first_document"] = {"tokens": int(len(first)), "ids": [int(i) for i in first[:16]]}
        if callable(decoder):
            text = decoder(first)
            summary["first_document"]["text"] = text[:FIRST_DOCUMENT_CHARS]
            summary["first_document"]["text_cut"] = len(text) > FIRST_DOCUMENT_CHARS
        else:
            summary["first_document"]["not_decoded"] = decoder
    return summary
