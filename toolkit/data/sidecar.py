"""`PREFIX.dmt.json`: what `dmt data prepare` made and from what (the tokenizer's identity, the inputs, the keys and
flags, each key's dataset with its counts). Written last, so its presence says the datasets beside it are whole;
training resolves a blend's prefix to its datasets through it."""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import UserInputError
from toolkit.readers import read_json

SUFFIX = ".dmt.json"
FORMAT = "dmt-prepared-tokens"
VERSION = 1
LEVEL = "document"  # the reference's file level without --split-sentences: PREFIX_<key>_document.bin/.idx
WHAT = f"the {SUFFIX} record `dmt data prepare` writes beside its datasets"


def sidecar_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}{SUFFIX}")


def dataset_prefix(prefix: str | Path, key: str) -> str:
    """The Megatron dataset prefix of one key (its .bin and .idx add their suffixes), as the reference names it."""
    return f"{prefix}_{key}_{LEVEL}"


def megatron_prefix(prefix: str | Path, key: str) -> str:
    """The Megatron dataset prefix (what Megatron-LM's --data-path takes) of a blend's prefix: itself when it already
    names one key's dataset (PREFIX_<key>_document, as both tools name their outputs), else that dataset of an
    --output-prefix."""
    return str(prefix) if str(prefix).endswith(f"_{key}_{LEVEL}") else dataset_prefix(prefix, key)


def read_sidecar(prefix: str | Path, flag: str) -> dict:
    """The sidecar of `prefix`, checked to be one; each dataset's `prefix` resolved beside the sidecar."""
    path = sidecar_path(prefix)
    record = read_json(path, flag, what=WHAT)
    if record.get("format") != FORMAT or record.get("version") != VERSION:
        raise UserInputError(flag, f"{path} is not {WHAT} (format {FORMAT!r}, version {VERSION}); found format "
                                   f"{str(record.get('format'))[:40]!r}, version {str(record.get('version'))[:20]}")
    datasets = record.get("datasets")
    if not isinstance(datasets, dict) or not datasets or not all(
            isinstance(entry, dict) and isinstance(entry.get("prefix"), str) and entry["prefix"]
            and Path(entry["prefix"]).name == entry["prefix"] for entry in datasets.values()):
        raise UserInputError(flag, f"{path}: 'datasets' must map each key to an object whose 'prefix' is a file "
                                   f"name prefix beside it; expected {WHAT}")
    tokenizer = record.get("tokenizer")
    if tokenizer is not None and not (isinstance(tokenizer, dict) and isinstance(tokenizer.get("path"), str)):
        raise UserInputError(flag, f"{path}: 'tokenizer' must be an object with a 'path'; expected {WHAT}")
    for entry in datasets.values():
        entry["prefix"] = str(path.parent / entry["prefix"])
    return record
