"""The input files of `dmt data prepare` as chunks of documents: JSON lines (also gzipped), parquet, plain text (a
line a document). The main process cuts the files into chunks of about a block of bytes; the workers turn a chunk
into the documents of each key, read as the reference reads them, or say which line is wrong."""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import UserInputError
from toolkit.readers import DuplicateKey, not_a_file, unique_keys

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".txt": "text", ".text": "text"}
FORMAT_NAMES = "JSON lines (.jsonl, .json, also .gz), parquet (.parquet) or plain text (.txt, .text, also .gz)"
BLOCK_BYTES = 1 << 20  # a chunk of JSON lines or text: the unit of work of one worker, and what memory holds per task
PARQUET_ROWS = 1024  # the most rows of a chunk of a parquet file (fewer where its rows are long: _checked_row_group)
# the longest line (document) read, uncompressed: a worker's encoding of a line takes about 40 times its bytes (a
# 100 MB JSON line, from a 100 KB .gz, cost 4.2 GB), so a line past this is refused before it is held whole. 16 MiB is
# some 4M tokens, longer than any sequence a document is cut into
LINE_BYTES_MAX = 16 << 20
# parquet decompresses a row group's values of a key (a column chunk) page by page, and a page holds at least one whole
# value: a value past LINE_BYTES_MAX would be inflated before its length is known. The file's metadata records each
# chunk's uncompressed and compressed sizes, so a row group is refused before any of its pages is read when they show
# a value past the bound (more than LINE_BYTES_MAX a row on average) or an inflation no text reaches: more than
# LINE_BYTES_MAX at over PARQUET_INFLATION_MAX times its compressed size (Apache POI's ZipSecureFile refuses a zip
# entry that inflates over 100 times, MIN_INFLATE_RATIO = 0.01; text compresses some 3 to 10 times)
PARQUET_INFLATION_MAX = 100
# the reference reads its input with open(path, 'r', encoding='utf-8'): universal newlines, so \r\n, \r and \n each
# end a line (and nothing else: not U+2028, U+0085 or a form feed, which str.splitlines would split at)
_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str  # jsonl, parquet or text
    gzipped: bool
    size: int  # bytes on disk


@dataclass(frozen=True)
class Chunk:
    source: Path
    kind: str
    payload: object  # bytes (jsonl, text: whole lines) or {key: [values]} (parquet)
    disk_bytes: int  # how far into the file on disk this chunk reaches, from the previous chunk's end
    text_bytes: int  # the input bytes (uncompressed) it holds


def source_of(path: Path, keys: list[str], flag: str = "--input") -> Source:
    """What kind of input `path` is (by its name), checked to be a readable regular file."""
    path = Path(path)
    gzipped = path.suffix.lower() == ".gz"
    kind = FORMATS.get(Path(path.stem).suffix.lower() if gzipped else path.suffix.lower())
    if kind is None or (gzipped and kind == "parquet"):
        raise UserInputError(flag, f"{path}: expected {FORMAT_NAMES}")
    if not path.exists():
        raise UserInputError(flag, f"{path} does not exist; expected {FORMAT_NAMES}")
    if not_a_file(path):
        raise UserInputError(flag, f"{path} is {not_a_file(path)}, not a regular file")
    if path.stat().st_size == 0:
        raise UserInputError(flag, f"{path} is empty; expected {FORMAT_NAMES}")
    if kind == "text" and len(keys) != 1:
        raise UserInputError("--json-keys", f"{path} is plain text: one document a line, under one key; got "
                                            f"{len(keys)} keys ({' '.join(keys)})")
    return Source(path, kind, gzipped, path.stat().st_size)


def chunks(source: Source, keys: list[str], flag: str = "--input", block_bytes: int = BLOCK_BYTES):
    """The chunks of one input, in order; a file that cannot be read is one line naming it."""
    try:
        if source.kind == "parquet":
            yield from _parquet_chunks(source, keys, flag)
        else:
            yield from _line_chunks(source, block_bytes, flag)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise UserInputError(flag, f"{source.path} cannot be read ({getattr(exc, 'strerror', None) or exc})") \
            from None


def _line_chunks(source: Source, block_bytes: int, flag: str = "--input"):
    """Blocks of whole lines: cut after the last line end of each block (a \\r only where the next byte is known not
    to be \\n); a line longer than a block makes its block longer, up to LINE_BYTES_MAX (past it: one line naming
    the file and the line, before the line is held whole)."""
    with open(source.path, "rb") as raw:
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if source.gzipped else raw
        pending, consumed, lines = b"", 0, 0
        while True:
            data = stream.read(block_bytes)
            buffer = pending + data
            if len(buffer) > LINE_BYTES_MAX and max(buffer.rfind(b"\n", 0, LINE_BYTES_MAX + 1),
                                                    buffer.rfind(b"\r", 0, LINE_BYTES_MAX + 1)) < 0:
                raise UserInputError(flag, f"{source.path} line {lines + 1} is longer than {LINE_BYTES_MAX >> 20} MiB"
                                           f"{' uncompressed' if source.gzipped else ''}; a document of at most that "
                                           f"is read (split it into several lines)")
            if not data:
                if buffer:
                    yield Chunk(source.path, source.kind, buffer, raw.tell() - consumed, len(buffer))
                return
            cut = max(buffer.rfind(b"\n"), buffer.rfind(b"\r", 0, len(buffer) - 1)) + 1
            if cut == 0:
                pending = buffer
                continue
            pending = buffer[cut:]
            position = raw.tell()
            block = buffer[:cut]
            lines += block.count(b"\n") + block.count(b"\r") - block.count(b"\r\n")
            yield Chunk(source.path, source.kind, block, position - consumed, cut)
            consumed = position


def _parquet_chunks(source: Source, keys: list[str], flag: str):
    import pyarrow
    import pyarrow.compute
    import pyarrow.parquet

    try:
        handle = pyarrow.parquet.ParquetFile(source.path)
    except (pyarrow.ArrowException, OSError) as exc:
        raise UserInputError(flag, f"{source.path} is not a parquet file ({str(exc)[:200]})") from None
    missing = [key for key in keys if key not in handle.schema_arrow.names]
    if missing:
        raise UserInputError("--json-keys", f"{source.path} has no column {', '.join(map(repr, missing))}; its "
                                            f"columns: {', '.join(handle.schema_arrow.names)}")
    rows = max(handle.metadata.num_rows, 1)
    try:
        for group in range(handle.metadata.num_row_groups):
            batch_rows = _checked_row_group(source, handle.metadata.row_group(group), group, keys, flag)
            for batch in handle.iter_batches(batch_size=batch_rows, row_groups=[group], columns=keys,
                                             use_threads=False):
                strings = [batch.column(key) for key in keys if pyarrow.types.is_string(batch.column(key).type)
                           or pyarrow.types.is_large_string(batch.column(key).type)]
                longest = max((pyarrow.compute.max(pyarrow.compute.binary_length(column)).as_py() or 0
                               for column in strings), default=0)
                if longest > LINE_BYTES_MAX:
                    raise UserInputError(flag, f"{source.path} holds a value of {longest >> 20} MiB, longer than the "
                                               f"{LINE_BYTES_MAX >> 20} MiB a document may be")
                columns = {key: batch.column(key).to_pylist() for key in keys}
                text_bytes = sum(len(value.encode()) for value in columns[keys[0]] if isinstance(value, str))
                yield Chunk(source.path, source.kind, columns, source.size * batch.num_rows // rows, text_bytes)
    except pyarrow.ArrowException as exc:
        raise UserInputError(flag, f"{source.path} cannot be read as parquet ({str(exc)[:200]})") from None


def _checked_row_group(source: Source, group, number: int, keys: list[str], flag: str) -> int:
    """The rows of a batch of this row group (its metadata, `group`) that hold about BLOCK_BYTES of its keys' values
    by the sizes the file records (1 to PARQUET_ROWS), once those sizes show no value past LINE_BYTES_MAX and no
    inflation past PARQUET_INFLATION_MAX (nothing of the row group is read)."""
    rows = max(group.num_rows, 1)
    uncompressed, compressed = dict.fromkeys(keys, 0), dict.fromkeys(keys, 0)
    for index in range(group.num_columns):
        column = group.column(index)
        key = next((k for k in keys if column.path_in_schema == k or column.path_in_schema.startswith(f"{k}.")), None)
        if key is not None:
            uncompressed[key] += column.total_uncompressed_size
            compressed[key] += column.total_compressed_size
    for key in keys:
        where = f"{source.path} row group {number} ({key!r}: {group.num_rows} rows, {uncompressed[key]} bytes " \
                f"uncompressed, {compressed[key]} compressed)"
        if uncompressed[key] > LINE_BYTES_MAX * rows:
            raise UserInputError(flag, f"{where} holds a value longer than the {LINE_BYTES_MAX >> 20} MiB a document "
                                       f"may be; refused unread")
        if uncompressed[key] > max(LINE_BYTES_MAX, PARQUET_INFLATION_MAX * compressed[key]):
            raise UserInputError(flag, f"{where} inflates over {PARQUET_INFLATION_MAX} times, as no text does (a "
                                       f"compression bomb); refused unread: expected parquet of documents")
    return max(1, min(PARQUET_ROWS, BLOCK_BYTES * rows // max(sum(uncompressed.values()), 1)))


class BadDocument(Exception):
    """A document of a chunk that cannot be read: `where` is its line or row within the chunk (1-based)."""

    def __init__(self, where: int, message: str):
        super().__init__(where, message)
        self.where, self.message = where, message


def documents(chunk: Chunk, keys: list[str]) -> tuple[dict[str, list[list[str]]], int]:
    """{key: [the sentences of each document]} of a chunk, and how many lines (rows) it holds. A document's value
    is one string or a list of strings (the reference tokenizes each string as a sentence)."""
    if chunk.kind == "parquet":
        rows = len(chunk.payload[keys[0]])
        return {key: [_sentences(value, key, row) for row, value in enumerate(chunk.payload[key], 1)]
                for key in keys}, rows
    try:
        text = chunk.payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = chunk.payload[:exc.start].count(b"\n") + 1
        raise BadDocument(line, f"is not UTF-8 (byte {chunk.payload[exc.start]:#04x})") from None
    lines = _LINE_END.split(text)
    if lines and lines[-1] == "":  # the last line's end, not a line
        lines.pop()
    if chunk.kind == "text":
        return {keys[0]: [[line] for line in lines]}, len(lines)
    found = {key: [] for key in keys}
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line, object_pairs_hook=unique_keys)
        except DuplicateKey as exc:
            raise BadDocument(number, f"{exc} (which text would be tokenized is unclear)") from None
        except json.JSONDecodeError as exc:
            raise BadDocument(number, f"is not a JSON object ({exc.msg}, column {exc.colno})") from None
        except RecursionError:
            raise BadDocument(number, "nests too deep to be read as JSON") from None
        if not isinstance(record, dict):
            raise BadDocument(number, f"holds a JSON {type(record).__name__}, not an object")
        for key in keys:
            if key not in record:
                words = f"; --json-keys takes one key per word (--json-keys {' '.join(key.split(','))})" \
                    if "," in key else ""
                raise BadDocument(number, f"has no key {key!r} (--json-keys); its keys: "
                                          f"{', '.join(map(repr, list(record)[:10]))}{words}")
            found[key].append(_sentences(record[key], key, number))
    return found, len(lines)


def _sentences(value, key: str, where: int) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    kind = "null" if value is None else type(value).__name__
    raise BadDocument(where, f"has {kind} under {key!r}; expected a string or a list of strings")
