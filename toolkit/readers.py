"""The one reading path per file format: any read, decode or shape error becomes one UserInputError line naming the
file and what was expected, never a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from toolkit.errors import UserInputError
from toolkit.numeric import NOT_FINITE, non_finite


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (YAML and validation errors span several, with carets)."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def problem(path: Path | str, key: str | None, message: str) -> UserInputError:
    """One line naming the file: `KEY: PATH <message>`, or `PATH: <message>` when no flag names it."""
    return UserInputError(key, f"{path} {message}") if key else UserInputError(str(path), message)


def read_text(path: Path, key: str | None = None, what: str = "a text file") -> str:
    """UTF-8 text; `key` names the flag or setting that gave the path (the path itself names it otherwise)."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise problem(path, key, f"does not exist; expected {what}") from None
    except IsADirectoryError:
        raise problem(path, key, f"is a directory; expected {what}") from None
    except UnicodeDecodeError:
        raise problem(path, key, f"is not UTF-8 text; expected {what}") from None
    except OSError as exc:
        raise problem(path, key, f"cannot be read ({exc.strerror or one_line(exc)})") from None


def _shape(data: Any, path: Path | str, key: str | None, expect: type | None, what: str) -> Any:
    if expect is not None and not isinstance(data, expect):
        found = "nothing" if data is None else f"a {type(data).__name__}"
        raise problem(path, key, f"holds {found} at the top level; expected {what}")
    return data


def _finite(data: Any, path: Path | str, key: str | None, what: str) -> Any:
    """JSON's NaN and Infinity tokens (Python's json reads them), 1e999 (read as inf) and YAML's .nan and .inf are
    refused here, naming where in the file, so no reader downstream ever sees one."""
    found = non_finite(data)
    if found is not None:
        raise problem(path, key, f"holds {found[1]} at {found[0]}, {NOT_FINITE}; expected {what}")
    return data


def read_json(path: Path, key: str | None = None, expect: type | None = dict, what: str = "a JSON object") -> Any:
    """A JSON document whose top level is `expect` (dict by default; None: anything)."""
    path = Path(path)
    text = read_text(path, key, what)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise problem(path, key, f"is not valid JSON ({exc.msg} at line {exc.lineno}); expected {what}") from None
    return _finite(_shape(data, path, key, expect, what), path, key, what)


def read_yaml(path: Path, key: str | None = None, expect: type | None = dict, what: str = "a YAML mapping") -> Any:
    """A YAML document whose top level is `expect` (dict by default; None: anything)."""
    path = Path(path)
    return parse_yaml(read_text(path, key, what), path, key, expect, what)


def parse_yaml(text: str, source: Path | str, key: str | None = None, expect: type | None = dict,
               what: str = "a YAML mapping") -> Any:
    """A YAML document given as text (an upload, or a file read_yaml read); `source` names it in errors."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise problem(source, key, f"is not valid YAML ({one_line(exc)}); expected {what}") from None
    return _finite(_shape(data, source, key, expect, what), source, key, what)


# safetensors (its docs, "Format"): an 8-byte little-endian header length, a JSON header mapping each tensor name to
# dtype, shape and [begin, end) offsets into the data that follows; safetensors itself refuses headers over 100 MB
SAFETENSORS_HEADER_LIMIT = 100_000_000


def read_safetensors_header(path: Path, key: str | None = None) -> dict[str, dict]:
    """The tensors of a safetensors file, name -> {"dtype", "shape", "data_offsets"}, checked to lie inside the
    file (so that safetensors' own reader can then map them); `__metadata__` is left out."""
    import struct

    path = Path(path)
    what = "a safetensors file (8-byte header length, JSON header, tensor data)"
    fault = key or str(path)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
            if not 2 <= length <= min(size - 8, SAFETENSORS_HEADER_LIMIT):
                raise UserInputError(fault, f"{path} has no valid header ({size} bytes, header length "
                                            f"{length}); expected {what}")
            text = handle.read(length)
    except OSError as exc:
        raise UserInputError(fault, f"cannot read {path} ({exc.strerror or one_line(exc)}); expected {what}") from None
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserInputError(fault, f"{path}: its header is not JSON; expected {what}") from None
    if not isinstance(header, dict):
        raise UserInputError(fault, f"{path}: its header is not a JSON object; expected {what}")
    data = size - 8 - length
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    for name, entry in tensors.items():
        if not _safetensors_entry_fits(entry, data):
            raise UserInputError(fault, f"{path}: header entry {name!r} is not a dtype, shape and offsets inside "
                                        f"the file's {data} data bytes (truncated or corrupt); expected {what}")
    return tensors


def _safetensors_entry_fits(entry: Any, data_bytes: int) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    return (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes)

